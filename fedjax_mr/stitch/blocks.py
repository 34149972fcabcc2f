"""Pre-trained networks cut into chains of blocks (FedStitch §III).

A zoo model is described as an ordered list of *units*, the pieces between
the points where the whole network state is one tensor (between residual
blocks, never inside one). A *cut list* names the units at which a new
block begins; the blocks of a model are the runs of units between cuts,
typed 'start' (takes the model input), 'end' (gives the logits) and
'middle'. Every block carries its input/output spec (one example's shape,
`(H, W, C)`, `(T, D)` or `(D,)`), its slice of the model's variables and a
pure inference-mode apply function.

Default cut lists follow StitchNet's rule as FedStitch uses it (see the
project notes): a cut at the input of every convolution whose input feeds
nothing but convolutions (never across a skip connection) and one cut at
the input of the classifier, which stays whole in the end block. 'per_linear'
cuts additionally before every dense layer of the head (StitchNet's own
fragmenter), 'every_unit' at every unit boundary.

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
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.models import layers
from fedjax_mr.models import lstm
from fedjax_mr.models import resnet
from fedjax_mr.models import vgg

KINDS = ('start', 'middle', 'end')
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


class Block(NamedTuple):
  """A contiguous run of units of one pre-trained model.

  Attributes:
    model: the pool model's id.
    index: position in the model's chain (0 = start).
    kind: 'start', 'middle' or 'end'.
    units: the unit names it spans.
    steps: the ops it runs.
    in_spec: one input example's shape.
    out_spec: one output example's shape.
    variables: the model variables the block uses (a subset of the
      model's collections, keyed by the same top-level names).
    fold: see `Unit.fold` (the block's first unit's).
  """

  model: str
  index: int
  kind: str
  units: tuple[str, ...]
  steps: tuple[Step, ...]
  in_spec: tuple[int, ...]
  out_spec: tuple[int, ...]
  variables: dict
  fold: tuple[str, tuple[tuple[str, ...], ...]] | None = None

  @property
  def id(self) -> tuple[str, int]:
    return (self.model, self.index)

  @property
  def spatial_in(self) -> bool:
    """Whether the input has spatial/sequence axes (rank ≥ 2 per example)."""
    return len(self.in_spec) >= 2

  def apply(self, x: jax.Array) -> jax.Array:
    """Inference-mode forward pass `[N, *in_spec] → [N, *out_spec]`."""
    return run_steps(self.steps, self.variables, x)

  def describe(self) -> str:
    return (
      f'{self.model}[{self.index}] {self.kind} {"+".join(self.units)} '
      f'{self.in_spec}→{self.out_spec}'
    )


class _Steps(nn.Module):
  """Runs a tuple of steps in inference mode."""

  steps: tuple[Step, ...]

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for op, name, args in self.steps:
      x = _STEP_OPS[op](x, name, args)
    return x


def _conv(x, name, args):
  features, kernel, strides, padding, bias = args
  return layers.Conv(
    features, kernel, strides, padding, use_bias=bias, name=name
  )(x)


_STEP_OPS = {
  'conv': _conv,
  'bn': lambda x, name, _: layers.batch_norm(x, False, None, name),
  'relu': lambda x, *_: nn.relu(x),
  'pool': lambda x, *_: layers.max_pool_2x2(x),
  'pool_ceil': lambda x, *_: vgg.max_pool_2x2_ceil(x),
  'flatten': lambda x, *_: x.reshape(x.shape[0], -1),
  'gap': lambda x, *_: jnp.mean(x, axis=(1, 2)),
  'gmax': lambda x, *_: jnp.max(x, axis=(1, 2)),
  'last': lambda x, *_: x[:, -1],
  'dense': lambda x, name, f: nn.Dense(f, name=name)(x),
  'embed': lambda x, name, a: nn.Embed(a[0], a[1], name=name)(
    x.astype(jnp.int32)
  ),
  'lstm': lambda x, name, h: lstm.LSTMLayer(h, name=name)(x),
  'preact': lambda x, name, a: resnet.PreActBottleneck(*a, name=name)(
    x, False, None
  ),
  'basic': lambda x, name, a: resnet.BasicBlock(*a, name=name)(x, False, None),
}


@functools.partial(jax.jit, static_argnums=0)
def run_steps(steps: tuple[Step, ...], variables: dict, x: jax.Array):
  """Runs `steps` with `variables` on a batch `x` (inference mode).

  FedStitch is a host pipeline of many small forward passes of different
  blocks and shapes, with no round function to compile once, so this is
  the one place it compiles (per steps and input shape).
  """
  return _Steps(steps).apply(variables, x)


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


_FOLD_AFTER = {'flatten': 'flatten', 'gap': 'matrix', 'last': 'matrix'}


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
  'vgg16': tuple(f'conv{i}' for i in range(13)) + ('head',),
  'char_lstm': ('embed', 'lstm1', 'head'),
}

NAMES = tuple(sorted(_UNITS))


def units(model_name: str, variables: dict, per_linear: bool = False):
  """The ordered units of a zoo model, read from its variables' shapes."""
  if model_name not in _UNITS:
    raise errors.ConfigError(
      f'--models: no block definition for model {model_name!r}; stitchable '
      'models: '
      f'{", ".join(NAMES)}'
    )
  return _UNITS[model_name](variables['params'], per_linear=per_linear)


def cut_list(model_name: str, variables: dict, style: str = 'default'):
  """The unit names at which blocks begin, for a cut style.

  Args:
    model_name: a zoo model.
    variables: its variables (the head's size decides 'per_linear').
    style: 'default' (StitchNet's rule, whole classifier in the end block),
      'per_linear' (also before every dense layer of the head) or
      'every_unit'.
  """
  if style not in CUT_STYLES:
    raise errors.ConfigError(
      f'--cuts: unknown cut style {style!r}; choose one of '
      f'{", ".join(CUT_STYLES)}'
    )
  all_units = units(model_name, variables, per_linear=style == 'per_linear')
  if style == 'every_unit':
    return tuple(u.name for u in all_units)
  cuts = list(_DEFAULT_CUTS[model_name])
  if style == 'per_linear':
    cuts = [c for c in cuts if c != 'head']
    cuts += [u.name for u in all_units if u.head]
  return tuple(cuts)


def _subset(variables: dict, names: Sequence[str]) -> dict:
  out = {}
  for collection, tree in variables.items():
    sub = {n: tree[n] for n in names if n in tree}
    if sub:
      out[collection] = sub
  return out


def _var_names(steps: Sequence[Step]) -> list[str]:
  return [name for _, name, _ in steps if name]


def split(
  model: str,
  model_name: str,
  variables: dict,
  input_shape: Sequence[int],
  cuts: Sequence[str] | str = 'default',
) -> tuple[Block, ...]:
  """Cuts a pre-trained zoo model into typed blocks.

  Args:
    model: the id the blocks carry (e.g. 'resnet20' or 'resnet20_b').
    model_name: the zoo name (decides the units).
    variables: the pre-trained variables.
    input_shape: one input example's shape.
    cuts: a cut style (see `cut_list`) or explicit unit names at which
      blocks begin, in chain order; the first unit always begins a block.

  Returns:
    The blocks in chain order; running them in turn equals the model's
    inference-mode forward pass.

  Raises:
    ConfigError: unknown model, cut style or unit name, cuts out of order.
  """
  style = cuts if isinstance(cuts, str) else 'default'
  chain = units(model_name, variables, per_linear=style == 'per_linear')
  if isinstance(cuts, str):
    cuts = cut_list(model_name, variables, cuts)
  names = [u.name for u in chain]
  unknown = [c for c in cuts if c not in names]
  if unknown:
    raise errors.ConfigError(
      f'--cuts for {model_name}: unknown unit(s) {", ".join(unknown)}; units '
      f'are {", ".join(names)}'
    )
  positions = sorted({names.index(c) for c in cuts} | {0})
  if [names.index(c) for c in cuts] != sorted(names.index(c) for c in cuts):
    raise errors.ConfigError(
      f'--cuts for {model_name}: give unit names in chain order ({cuts})'
    )
  if len(positions) < 2:
    raise errors.ConfigError(
      f'--cuts for {model_name}: need at least two blocks'
    )
  bounds = positions + [len(chain)]
  spec = jax.ShapeDtypeStruct(
    (1, *input_shape),
    jnp.int32 if model_name == 'char_lstm' else jnp.float32,
  )
  blocks = []
  for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
    steps = tuple(s for u in chain[lo:hi] for s in u.steps)
    block_vars = _subset(variables, _var_names(steps))
    out = jax.eval_shape(functools.partial(run_steps, steps), block_vars, spec)
    kind = 'start' if b == 0 else 'end' if b == len(bounds) - 2 else 'middle'
    blocks.append(
      Block(
        model=model,
        index=b,
        kind=kind,
        units=tuple(u.name for u in chain[lo:hi]),
        steps=steps,
        in_spec=tuple(spec.shape[1:]),
        out_spec=tuple(out.shape[1:]),
        variables=block_vars,
        fold=chain[lo].fold,
      )
    )
    spec = jax.ShapeDtypeStruct(out.shape, out.dtype)
  return tuple(blocks)


def block_bytes(block: Block) -> int:
  """Bytes of the block's variables."""
  return int(
    sum(np.asarray(v).nbytes for v in jax.tree.leaves(block.variables))
  )
