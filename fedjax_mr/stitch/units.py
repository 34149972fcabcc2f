"""The zoo's models described as chains of units, and their cut lists
(FedStitch §III; `blocks` cuts the chains into blocks).

A zoo model is an ordered list of *units*, the pieces between the points
where the whole network state is one tensor (between residual blocks,
never inside one); each unit is a tuple of *steps* (one layer or
parameter-free op each, run by `blocks.run_steps`). A *cut list* names the
units at which a new block begins.

Default cut lists follow StitchNet's rule as FedStitch uses it (see the
project notes): a cut at the input of every convolution whose input feeds
nothing but convolutions (never across a skip connection) and one cut at
the input of the classifier, which stays whole in the end block. 'per_linear'
cuts additionally before every dense layer of the head (StitchNet's own
fragmenter), 'every_unit' at every unit boundary.

The ImageNet models of FedStitch's pool (`fedjax_mr.models.imagenet`, in
torchvision's layout) are described from their modules' configuration;
their default cut lists give the paper's 6 / 14 / 6 / 6 / 20 blocks (see
`_IMAGENET_UNITS` for the two lists that are not StitchNet's rule). A start
unit of a model with input preprocessing begins with it, so the block
takes the dataset's examples.

References:
  Teerapittayanon et al., "StitchNet: Composing Neural Networks from
  Pre-Trained Fragments", 2023; "Heterogeneity-Aware Coordination for
  Federated Learning via Stitching Pre-trained blocks" (FedStitch), 2024.
"""

from __future__ import annotations

import functools
from typing import Any
from typing import NamedTuple
from typing import Sequence

import flax.linen as nn

from fedjax_mr.core import errors
from fedjax_mr.models import imagenet
from fedjax_mr.models import vgg

CUT_STYLES = ('default', 'per_linear', 'every_unit')

# A step is (op, name, args): one layer or parameter-free op of a unit.
Step = tuple[str, str, Any]


class Unit(NamedTuple):
  """The smallest chain piece of a model.

  Attributes:
    name: the unit's name (what cut lists refer to).
    steps: the ops it runs, in order.
    fold: how a channel projection of the unit's input can be folded into
      its first layer exactly, or None: `('conv', paths)` (HWIO kernels,
      input channels on axis 2), `('matrix', paths)` (dense kernels `[D, O]`
      after an op that commutes with a channel map: global average pool,
      last step of a sequence, a sequence layer), `('flatten', paths)`
      (dense kernels after flattening `[..., C]`). `paths` are the kernels'
      paths in `params`.
    head: whether the unit belongs to the classifier head.
  """

  name: str
  steps: tuple[Step, ...]
  fold: tuple[str, tuple[tuple[str, ...], ...]] | None = None
  head: bool = False


# --- The zoo's units --------------------------------------------------------


def _conv_step(params, name, padding, strides=(1, 1)) -> Step:
  k = params[name]['kernel']
  pad = padding if isinstance(padding, str) else tuple(map(tuple, padding))
  return (
    'conv',
    name,
    (
      int(k.shape[-1]),
      tuple(k.shape[:2]),
      strides,
      pad,
      'bias' in params[name],
    ),
  )


_FOLD_AFTER = {
  'flatten': 'flatten',
  'adaptive_avg': 'flatten',  # then 'flatten': still channels last
  'gap': 'matrix',
  'last': 'matrix',
}


def _dense_head(params, names, pre: tuple[Step, ...], per_linear: bool):
  """Head units: `pre` ops, then dense layers with ReLU between them.

  One unit for the whole head, or one per dense layer (`per_linear`).
  """
  layers_ = []
  for i, name in enumerate(names):
    steps = [('dense', name, int(params[name]['kernel'].shape[-1]))]
    if i + 1 < len(names):
      steps.append(('relu', '', None))
    layers_.append(steps)
  first_fold = _FOLD_AFTER.get(pre[0][0]) if pre else 'matrix'
  first = (first_fold, ((names[0], 'kernel'),)) if first_fold else None
  if not per_linear:
    steps = (*pre, *(s for steps in layers_ for s in steps))
    return [Unit('head', steps, first, head=True)]
  return [
    Unit(
      f'fc{i}',
      tuple((*pre, *steps) if i == 0 else steps),
      first if i == 0 else ('matrix', ((names[i], 'kernel'),)),
      head=True,
    )
    for i, steps in enumerate(layers_)
  ]


def _cnn_units(params, *, padding, relu_first, per_linear):
  units = []
  for i in range(2):
    name = f'Conv_{i}'
    act = (('relu', '', None), ('pool', '', None))
    steps = (
      _conv_step(params, name, padding),
      *(act if relu_first else act[::-1]),
    )
    units.append(Unit(f'conv{i}', steps, ('conv', ((name, 'kernel'),))))
  dense = sorted(k for k in params if k.startswith('Dense_'))
  dense.sort(key=lambda k: int(k.split('_')[1]))
  head = _dense_head(params, dense, (('flatten', '', None),), per_linear)
  return units + head


def _resnet20_units(params, per_linear):
  del per_linear  # one dense layer
  pad1 = ((1, 1), (1, 1))
  units = [
    Unit(
      'conv1',
      (_conv_step(params, 'conv1', pad1),),
      ('conv', (('conv1', 'kernel'),)),
    )
  ]
  for i, stride in enumerate((1, 2, 2)):
    for j in range(2):
      name = f'layer{i + 1}_{j}'
      planes = int(params[name]['conv1']['kernel'].shape[-1])
      units.append(
        Unit(name, (('preact', name, (planes, stride if j == 0 else 1)),))
      )
  pre = (('gap', '', None),)
  if 'bn' in params:
    pre = (('bn', 'bn', None), ('relu', '', None), *pre)
  head = (*pre, ('dense', 'linear', int(params['linear']['kernel'].shape[-1])))
  fold = None if 'bn' in params else ('matrix', (('linear', 'kernel'),))
  return units + [Unit('head', head, fold, head=True)]


def _resnet18_units(params, per_linear):
  del per_linear
  pad1 = ((1, 1), (1, 1))
  stem = (
    _conv_step(params, 'conv1', pad1),
    ('bn', 'bn1', None),
    ('relu', '', None),
  )
  units = [Unit('stem', stem, ('conv', (('conv1', 'kernel'),)))]
  for i, stride in enumerate((1, 2, 2, 2)):
    for j in range(2):
      name = f'layer{i + 1}_{j}'
      planes = int(params[name]['conv1']['kernel'].shape[-1])
      fold = None
      if 'shortcut_conv' in params[name]:
        # The input feeds two convolutions and nothing else.
        fold = (
          'conv',
          ((name, 'conv1', 'kernel'), (name, 'shortcut_conv', 'kernel')),
        )
      units.append(
        Unit(name, (('basic', name, (planes, stride if j == 0 else 1)),), fold)
      )
  head = (
    ('gap', '', None),
    ('dense', 'linear', int(params['linear']['kernel'].shape[-1])),
  )
  return units + [
    Unit('head', head, ('matrix', (('linear', 'kernel'),)), head=True)
  ]


def _vgg16_units(params, per_linear):
  units, i = [], 0
  pattern = vgg.VGG16_PATTERN
  for pos, v in enumerate(pattern):
    if v == 'M':
      continue
    name = f'conv{i}'
    steps = [
      _conv_step(params, name, ((1, 1), (1, 1))),
      ('bn', f'bn{i}', None),
      ('relu', '', None),
    ]
    if pos + 1 < len(pattern) and pattern[pos + 1] == 'M':
      steps.append(('pool_ceil', '', None))
    units.append(Unit(name, tuple(steps), ('conv', ((name, 'kernel'),))))
    i += 1
  head = _dense_head(
    params, ('fc0', 'fc1', 'fc2'), (('gmax', '', None),), per_linear
  )
  return units + head  # A global max does not commute: no fold into fc0.


def _char_lstm_units(params, per_linear):
  del per_linear
  vocab, dim = params['embed']['embedding'].shape
  units = [Unit('embed', (('embed', 'embed', (int(vocab), int(dim))),))]
  for i in range(sum(k.startswith('lstm') for k in params)):
    name = f'lstm{i}'
    hidden = int(params[name]['w_hh'].shape[0])
    units.append(
      Unit(name, (('lstm', name, hidden),), ('matrix', ((name, 'w_ih'),)))
    )
  head = (
    ('last', '', None),
    ('dense', 'fc', int(params['fc']['kernel'].shape[-1])),
  )
  return units + [
    Unit('head', head, ('matrix', (('fc', 'kernel'),)), head=True)
  ]


_UNITS = {
  'cnn_mnist': functools.partial(_cnn_units, padding='VALID', relu_first=False),
  'cnn_femnist': functools.partial(
    _cnn_units, padding='VALID', relu_first=False
  ),
  'cnn_cifar': functools.partial(_cnn_units, padding='VALID', relu_first=True),
  'cnn_fedavg': functools.partial(_cnn_units, padding='SAME', relu_first=True),
  'resnet20': _resnet20_units,
  'resnet18': _resnet18_units,
  'resnet18_w16': _resnet18_units,  # read from the variables: any width
  'vgg16': _vgg16_units,
  'char_lstm': _char_lstm_units,
}

# Default cuts (StitchNet's rule, whole head): where a new block begins.
_DEFAULT_CUTS = {
  'cnn_mnist': ('conv0', 'conv1', 'head'),
  'cnn_femnist': ('conv0', 'conv1', 'head'),
  'cnn_cifar': ('conv0', 'conv1', 'head'),
  'cnn_fedavg': ('conv0', 'conv1', 'head'),
  'resnet20': ('conv1', 'layer1_0', 'layer2_0', 'layer3_0', 'head'),
  'resnet18': ('stem', 'layer2_0', 'layer3_0', 'layer4_0', 'head'),
  'resnet18_w16': ('stem', 'layer2_0', 'layer3_0', 'layer4_0', 'head'),
  'vgg16': tuple(f'conv{i}' for i in range(13)) + ('head',),
  'char_lstm': ('embed', 'lstm1', 'head'),
}

# --- The ImageNet pool's units (torchvision's layout) -----------------------
#
# Read from the module's configuration (`fedjax_mr.models.imagenet`): strides
# and activations are not in the variables. FedStitch's counts are 6
# (AlexNet), 14 (VGG-16), 6 (ResNet-50), 6 (DenseNet-121) and 20 (MobileNet)
# blocks. StitchNet's rule gives the first three. It gives DenseNet-121 five
# (a cut before each transition's convolution: every other tensor feeds a
# concatenation), so its default list also cuts between the stem and the
# first dense block, as ResNet-50's does (our choice). It gives
# MobileNetV3-Large 13 (a cut before the expansion and the projection of
# each of the five blocks without a shortcut, before the last convolution
# and before the classifier), so its default list is ours: one block per
# top-level module of torchvision's network (the 17 modules of `features`,
# the average pool and each linear layer of `classifier`), which is 20.


def _conv_args(features, kernel, stride, pad, bias) -> tuple:
  p = ((pad, pad), (pad, pad))
  return (features, (kernel, kernel), (stride, stride), p, bias)


def _conv_unit(name, args, *after: Step) -> Unit:
  steps = (('conv', name, args), *after)
  return Unit(name, steps, ('conv', ((name, 'kernel'),)))


def _alexnet_units(params, m, per_linear):
  convs = zip(m.widths, imagenet.ALEXNET_CONVS)
  units = []
  for i, (w, (k, s, p, pool)) in enumerate(convs):
    after = [('relu', '', None)] + ([('maxpool', '', (3, 2, 0))] * pool)
    units.append(_conv_unit(f'conv{i}', _conv_args(w, k, s, p, True), *after))
  pre = (('adaptive_avg', '', (m.pool_size,) * 2), ('flatten', '', None))
  return units + _dense_head(params, ('fc0', 'fc1', 'fc2'), pre, per_linear)


def _imagenet_vgg16_units(params, m, per_linear):
  units = []
  for i, w in enumerate(m.widths):
    after = [('relu', '', None)]
    if i in imagenet.VGG16_POOL_AFTER:
      after.append(('pool', '', None))
    units.append(_conv_unit(f'conv{i}', _conv_args(w, 3, 1, 1, True), *after))
  pre = (('adaptive_avg', '', (m.pool_size,) * 2), ('flatten', '', None))
  return units + _dense_head(params, ('fc0', 'fc1', 'fc2'), pre, per_linear)


def _resnet50_units(params, m, per_linear):
  del params, per_linear  # one dense layer
  stem = _conv_unit(
    'conv1',
    _conv_args(m.stem_width, 7, 2, 3, False),
    ('bn', 'bn1', None),
    ('relu', '', None),
    ('maxpool', '', (3, 2, 1)),
  )
  units = [stem._replace(name='stem')]
  channels = m.stem_width
  for i, (planes, depth) in enumerate(zip(m.widths, m.depths)):
    for j in range(depth):
      name, stride = f'layer{i + 1}_{j}', 2 if i > 0 and j == 0 else 1
      fold = None
      if stride != 1 or channels != planes * m.expansion:
        # The input feeds two convolutions and nothing else.
        conv1 = (name, 'conv1', 'kernel')
        fold = ('conv', (conv1, (name, 'downsample_conv', 'kernel')))
      step = ('bottleneck', name, (planes, stride, m.expansion))
      units.append(Unit(name, (step,), fold))
      channels = planes * m.expansion
  head = (('gap', '', None), ('dense', 'fc', m.num_classes))
  return units + [Unit('head', head, ('matrix', (('fc', 'kernel'),)), True)]


def _densenet121_units(params, m, per_linear):
  del params, per_linear
  stem = _conv_unit(
    'conv0',
    _conv_args(m.num_init_features, 7, 2, 3, False),
    ('bn', 'norm0', None),
    ('relu', '', None),
    ('maxpool', '', (3, 2, 1)),
  )
  units = [stem._replace(name='stem')]
  channels = m.num_init_features
  for b, n_layers in enumerate(m.block_config):
    for i in range(n_layers):
      name = f'denseblock{b + 1}_layer{i + 1}'
      args = (m.growth_rate, m.bn_size)
      units.append(Unit(name, (('dense_layer', name, args),)))
      channels += m.growth_rate
    if b + 1 < len(m.block_config):
      t = f'transition{b + 1}'
      bn_relu = (('bn', f'{t}_norm', None), ('relu', '', None))
      units.append(Unit(f'{t}_norm', bn_relu))
      channels //= 2
      conv = _conv_unit(
        f'{t}_conv',
        _conv_args(channels, 1, 1, 0, False),
        ('avgpool', '', (2, 2)),
      )
      units.append(conv._replace(name=t))
  units.append(Unit('norm5', (('bn', 'norm5', None), ('relu', '', None))))
  head = (('gap', '', None), ('dense', 'classifier', m.num_classes))
  fold = ('matrix', (('classifier', 'kernel'),))
  return units + [Unit('head', head, fold, True)]


def _mobilenet_v3_large_units(params, m, per_linear):
  del params, per_linear  # the head is always cut per layer
  settings = tuple(imagenet.BneckConfig(*s) for s in m.settings)
  stem_args = (settings[0].input_channels, 3, 2, 1, 'HS', 1e-3)
  stem_fold = ('conv', (('stem', 'conv', 'kernel'),))
  units = [Unit('stem', (('conv_bn_act', 'stem', stem_args),), stem_fold)]
  for i, cfg in enumerate(settings):
    name, fold = f'block{i + 1}', None
    if not cfg.residual and cfg.expanded_channels != cfg.input_channels:
      fold = ('conv', ((name, 'expand', 'conv', 'kernel'),))
    units.append(Unit(name, (('inverted_residual', name, cfg),), fold))
  last_args = (6 * settings[-1].out_channels, 1, 1, 1, 'HS', 1e-3)
  last_fold = ('conv', (('last_conv', 'conv', 'kernel'),))
  units.append(
    Unit('last_conv', (('conv_bn_act', 'last_conv', last_args),), last_fold)
  )
  fc0 = (('dense', 'fc0', m.last_channel), ('hardswish', '', None))
  return units + [
    Unit('pool', (('gap', '', None),), None, True),
    Unit('fc0', fc0, ('matrix', (('fc0', 'kernel'),)), True),
    Unit(
      'fc1',
      (('dense', 'fc1', m.num_classes),),
      ('matrix', (('fc1', 'kernel'),)),
      True,
    ),
  ]


_IMAGENET_UNITS = {
  'alexnet': _alexnet_units,
  'vgg16': _imagenet_vgg16_units,
  'resnet50': _resnet50_units,
  'densenet121': _densenet121_units,
  'mobilenet_v3_large': _mobilenet_v3_large_units,
}


def _imagenet_default_cuts(arch: str, chain: Sequence[Unit]) -> list[str]:
  names = [u.name for u in chain]
  if arch == 'resnet50':  # StitchNet's rule: stage inputs with a downsample
    stages = [u.name for u in chain[1:-1] if u.fold]
    return ['stem', *stages, 'head']
  if arch == 'densenet121':  # StitchNet's rule + the first dense block
    transitions = [n for n in names if n.startswith('transition')]
    transitions = [n for n in transitions if not n.endswith('_norm')]
    return ['stem', 'denseblock1_layer1', *transitions, 'head']
  return names  # AlexNet, VGG-16 (StitchNet's rule), MobileNet (ours)


def _imagenet_units(arch, params, module, per_linear) -> list[Unit]:
  if module is None:
    module = imagenet.module(arch)
  chain = _IMAGENET_UNITS[arch](params, module, per_linear)
  if module.preprocess is not None:
    first = chain[0]
    steps = (('preprocess', '', module.preprocess), *first.steps)
    chain[0] = first._replace(steps=steps, fold=None)
  return chain


NAMES = tuple(sorted(_UNITS)) + tuple(
  imagenet.PREFIX + a for a in sorted(_IMAGENET_UNITS)
)


def units(
  model_name: str,
  variables: dict,
  per_linear: bool = False,
  module: nn.Module | None = None,
):
  """The ordered units of a zoo model, read from its variables' shapes.

  An ImageNet model (`imagenet_<arch>`) is read from its `module`'s
  configuration instead (default: torchvision's ImageNet network).
  """
  arch = imagenet.arch_of(model_name)
  if arch is not None:
    return _imagenet_units(arch, variables['params'], module, per_linear)
  if model_name not in _UNITS:
    raise errors.ConfigError(
      f'`model_name`: no block definition for model {model_name!r}; '
      'stitchable '
      'models: '
      f'{", ".join(NAMES)}'
    )
  return _UNITS[model_name](variables['params'], per_linear=per_linear)


def cut_list(
  model_name: str,
  variables: dict,
  style: str = 'default',
  module: nn.Module | None = None,
):
  """The unit names at which blocks begin, for a cut style.

  Args:
    model_name: a zoo model.
    variables: its variables (the head's size decides 'per_linear').
    style: 'default' (StitchNet's rule, whole classifier in the end block;
      for the ImageNet pool FedStitch's counts, see above),
      'per_linear' (also before every dense layer of the head) or
      'every_unit'.
    module: an ImageNet model's module (see `units`).
  """
  if style not in CUT_STYLES:
    raise errors.ConfigError(
      f'`cuts`: unknown cut style {style!r}; choose one of '
      f'{", ".join(CUT_STYLES)}'
    )
  all_units = units(model_name, variables, style == 'per_linear', module)
  if style == 'every_unit':
    return tuple(u.name for u in all_units)
  arch = imagenet.arch_of(model_name)
  if arch is not None:
    cuts = _imagenet_default_cuts(arch, all_units)
  else:
    cuts = list(_DEFAULT_CUTS[model_name])
  if style == 'per_linear':
    cuts = [c for c in cuts if c != 'head']
    cuts += [u.name for u in all_units if u.head and u.name not in cuts]
  return tuple(cuts)
