r"""Makes the torchvision-layout fixtures of the ImageNet-pool import tests.

For tests/stitch/test_torchvision_import.py: for each network of
FedStitch's ImageNet pool, a SMALL instance built from torchvision's own
classes (narrow layers, few blocks, 10 classes), so that its `state_dict()`
has exactly torchvision's key names and tensor layouts, with seeded random
weights and BatchNorm statistics. It writes, under
`tests/stitch/data/torchvision/`:

* `<arch>.safetensors`: the state dict (AlexNet in F16, VGG-16 in BF16, the
  others in F32: the reader's dtypes are exercised too), with the
  instance's Flax constructor arguments as JSON in the header's
  `__metadata__['fedjax_mr.config']`;
* `reference.npz`: per network a uint8 input batch (NHWC; the network's
  input is `(u - 127.5) / 64`, exact in float32) and the logits PyTorch
  computes for it in eval mode (float32, on the weights as stored); and
  torchvision-style resizing references for `imagenet.preprocess`
  (`F.interpolate(bilinear, align_corners=False, antialias=True)`).

PyTorch, torchvision and safetensors are needed here only, never by the
library or its tests:

  pip install --no-deps torchvision==0.29.2 safetensors
  python scripts/make_torchvision_fixtures.py

(made with torch 2.15.0, torchvision 0.29.2, safetensors 0.8.0).
"""

from __future__ import annotations

import json
import os

import numpy as np
import safetensors.torch
import torch
import torchvision
from torch import nn
from torch.nn import functional as F
from torchvision.models import mobilenetv3
from torchvision.models import resnet
from torchvision.models import vgg

OUT = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  'tests',
  'stitch',
  'data',
  'torchvision',
)
CLASSES = 10

# The Flax constructor arguments (fedjax_mr.models.imagenet) of each
# instance, the input side, and the dtype the weights are stored in.
CONFIGS = {
  'alexnet': (
    {'widths': [8, 16, 16, 16, 16], 'hidden': 32, 'pool_size': 6},
    159,  # the last map is 4×4: adaptive pooling to 6×6 overlaps
    torch.float16,
  ),
  'vgg16': (
    {'widths': [8, 8] + [16] * 11, 'hidden': 32, 'pool_size': 7},
    80,  # the last map is 2×2
    torch.bfloat16,
  ),
  'resnet50': (
    {'stem_width': 8, 'widths': [4, 8, 8, 8], 'depths': [2, 2, 1, 1]},
    64,
    torch.float32,
  ),
  'densenet121': (
    {
      'growth_rate': 4,
      'block_config': [2, 2, 2, 2],
      'num_init_features': 8,
      'bn_size': 2,
    },
    64,
    torch.float32,
  ),
  'mobilenet_v3_large': (
    {
      # No expansion + shortcut; expansion; SE + shortcut; SE + hard-swish
      # + stride 2; hard-swish + shortcut.
      'settings': [
        [8, 3, 8, 8, False, 'RE', 1],
        [8, 3, 16, 16, False, 'RE', 2],
        [16, 5, 24, 16, True, 'RE', 1],
        [16, 3, 32, 24, True, 'HS', 2],
        [24, 3, 48, 24, False, 'HS', 1],
      ],
      'last_channel': 32,
    },
    64,
    torch.float32,
  ),
}


def _alexnet(cfg):
  m = torchvision.models.AlexNet(num_classes=CLASSES)
  w = cfg['widths']
  convs = {0: (3, w[0], 11, 4, 2), 3: (w[0], w[1], 5, 1, 2)}
  convs |= {6: (w[1], w[2], 3, 1, 1), 8: (w[2], w[3], 3, 1, 1)}
  convs |= {10: (w[3], w[4], 3, 1, 1)}
  for i, (cin, cout, k, s, p) in convs.items():
    m.features[i] = nn.Conv2d(cin, cout, k, s, p)
  side, h = cfg['pool_size'], cfg['hidden']
  m.avgpool = nn.AdaptiveAvgPool2d((side, side))
  m.classifier[1] = nn.Linear(w[4] * side * side, h)
  m.classifier[4] = nn.Linear(h, h)
  m.classifier[6] = nn.Linear(h, CLASSES)
  return m


def _vgg16(cfg):
  widths = list(cfg['widths'])
  layout = []
  for i, w in enumerate(widths):
    layout.append(w)
    if i in (1, 3, 6, 9, 12):
      layout.append('M')
  m = vgg.VGG(vgg.make_layers(layout), num_classes=CLASSES)
  side, h = cfg['pool_size'], cfg['hidden']
  m.avgpool = nn.AdaptiveAvgPool2d((side, side))
  m.classifier[0] = nn.Linear(widths[-1] * side * side, h)
  m.classifier[3] = nn.Linear(h, h)
  m.classifier[6] = nn.Linear(h, CLASSES)
  return m


def _resnet50(cfg):
  m = resnet.ResNet(resnet.Bottleneck, [1, 1, 1, 1], num_classes=CLASSES)
  m.inplanes = cfg['stem_width']
  m.conv1 = nn.Conv2d(3, m.inplanes, 7, 2, 3, bias=False)
  m.bn1 = nn.BatchNorm2d(m.inplanes)
  for i, (planes, depth) in enumerate(zip(cfg['widths'], cfg['depths'])):
    stage = m._make_layer(resnet.Bottleneck, planes, depth, 1 if i == 0 else 2)
    setattr(m, f'layer{i + 1}', stage)
  m.fc = nn.Linear(m.inplanes, CLASSES)
  return m


def _densenet121(cfg):
  return torchvision.models.DenseNet(
    growth_rate=cfg['growth_rate'],
    block_config=tuple(cfg['block_config']),
    num_init_features=cfg['num_init_features'],
    bn_size=cfg['bn_size'],
    num_classes=CLASSES,
  )


def _mobilenet_v3_large(cfg):
  settings = [
    mobilenetv3.InvertedResidualConfig(*s[:7], dilation=1, width_mult=1.0)
    for s in cfg['settings']
  ]
  return mobilenetv3.MobileNetV3(
    settings, last_channel=cfg['last_channel'], num_classes=CLASSES
  )


BUILD = {
  'alexnet': _alexnet,
  'vgg16': _vgg16,
  'resnet50': _resnet50,
  'densenet121': _densenet121,
  'mobilenet_v3_large': _mobilenet_v3_large,
}


def _randomise(model: nn.Module, gen: torch.Generator) -> None:
  """He-scaled weights, small biases, BatchNorm affine and statistics away
  from their initial 1 / 0 (so a wrong mapping shows in the logits)."""
  with torch.no_grad():
    for mod in model.modules():
      if isinstance(mod, (nn.Conv2d, nn.Linear)):
        fan_in = mod.weight[0].numel()
        std = (2.0 / fan_in) ** 0.5
        mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * std)
        if mod.bias is not None:
          mod.bias.copy_(0.1 * torch.randn(mod.bias.shape, generator=gen))
      elif isinstance(mod, nn.BatchNorm2d):
        c = mod.num_features
        mod.weight.copy_(0.5 + torch.rand(c, generator=gen))
        mod.bias.copy_(0.1 * torch.randn(c, generator=gen))
        mod.running_mean.copy_(0.1 * torch.randn(c, generator=gen))
        mod.running_var.copy_(0.5 + torch.rand(c, generator=gen))
        mod.num_batches_tracked.fill_(7)


def _as_float32(v: torch.Tensor) -> torch.Tensor:
  return v.to(torch.float32) if v.is_floating_point() else v


def _resize_reference(rng, shape, size):
  """A uint8 batch and torchvision-style [0, 1] bilinear resize of it."""
  u = rng.integers(0, 256, shape, dtype=np.uint8)
  x = torch.from_numpy(u.astype(np.float32) / 255).permute(0, 3, 1, 2)
  y = F.interpolate(
    x, size=(size, size), mode='bilinear', align_corners=False, antialias=True
  )
  return u, y.permute(0, 2, 3, 1).numpy()


def main() -> None:
  os.makedirs(OUT, exist_ok=True)
  torch.manual_seed(0)
  rng = np.random.default_rng(0)
  arrays = {}
  for i, (arch, (cfg, side, dtype)) in enumerate(CONFIGS.items()):
    gen = torch.Generator().manual_seed(100 + i)
    model = BUILD[arch](cfg).eval()
    _randomise(model, gen)
    state = {
      k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
      for k, v in model.state_dict().items()
    }
    # The reference runs on the weights as stored.
    model.load_state_dict({k: _as_float32(v) for k, v in state.items()})
    u = rng.integers(0, 256, (2, side, side, 3), dtype=np.uint8)
    x = (torch.from_numpy(u).float() - 127.5) / 64
    with torch.no_grad():
      logits = model(x.permute(0, 3, 1, 2)).numpy()
    arrays[f'{arch}_input'] = u
    arrays[f'{arch}_logits'] = logits.astype(np.float32)
    config = {'num_classes': CLASSES, **cfg}
    safetensors.torch.save_file(
      state,
      os.path.join(OUT, f'{arch}.safetensors'),
      metadata={'fedjax_mr.config': json.dumps(config)},
    )
    print(f'{arch}: {len(state)} tensors, logits {logits[0, :3]}')
  # Up-sampling a grey image, down-sampling (antialiased) a colour one.
  arrays['up_input'], arrays['up_output'] = _resize_reference(
    rng, (2, 12, 12, 1), 32
  )
  arrays['down_input'], arrays['down_output'] = _resize_reference(
    rng, (2, 48, 48, 3), 20
  )
  np.savez_compressed(os.path.join(OUT, 'reference.npz'), **arrays)
  total = sum(os.path.getsize(os.path.join(OUT, f)) for f in os.listdir(OUT))
  print(f'{OUT}: {total} bytes')


if __name__ == '__main__':
  main()
