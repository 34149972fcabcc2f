"""ImageNet-1K classifiers in torchvision's layout, NHWC, inference only.

FedStitch's pool is five ImageNet-1K networks: ResNet-50, DenseNet-121, a
MobileNet, AlexNet and VGG-16 (the project notes reconstruct the names, lost
in the paper's text, from the model sizes it gives). These are Flax (linen)
definitions of torchvision's versions of them, so that torchvision's
published weights (`fedjax_mr.stitch.torchvision_import`) give the same
logits:

* `AlexNet`: torchvision's single-GPU variant (64, 192, 384, 256, 256
  channels), adaptive average pooling to 6×6, a 9216 → 4096 → 4096 → C
  classifier.
* `VGG16`: configuration D without BatchNorm, adaptive average pooling to
  7×7, 25088 → 4096 → 4096 → C.
* `ResNet50`: bottleneck stages [3, 4, 6, 3], the stride on the 3×3
  convolution (torchvision's "v1.5").
* `DenseNet121`: growth rate 32, blocks [6, 12, 24, 16], 64 initial
  features, bottleneck width 4 × growth.
* `MobileNetV3Large`: torchvision's `mobilenet_v3_large` (15 inverted
  residual blocks with squeeze-and-excitation and hard-swish where the
  paper puts them, a 960 → 1280 → C classifier, BatchNorm ε 1e-3).

Every constructor is configurable (widths, stage depths, growth rate, block
configuration, inverted-residual settings, classifier width, pooled size),
so tests build small instances with the same module and parameter layout.
Top-level sub-modules are named so that the block cuts of
`fedjax_mr.stitch.blocks` fall between them. Every module may start with
`Preprocess`: the dataset's model input (`x * scale + shift` of stored
0–255 values) is brought back to [0, 1], grey images get three channels,
the image is resized (bilinear, antialiased) to the pool's resolution and
normalised with ImageNet's mean and standard deviation.

Dropout is the identity and BatchNorm uses its running statistics: these
modules run in inference mode only (FedStitch never trains).

References:
  torchvision's `models` package (the layout and names followed; Marcel &
  Rodriguez, "Torchvision the machine-vision package of torch", ACM MM
  2010); Krizhevsky, "One weird trick for parallelizing convolutional
  neural networks", 2014 (AlexNet as torchvision has it); Simonyan &
  Zisserman, "Very Deep Convolutional Networks for Large-Scale Image
  Recognition", ICLR 2015; He et al., "Deep Residual Learning for Image
  Recognition", CVPR 2016; Huang et al., "Densely Connected Convolutional
  Networks", CVPR 2017; Howard et al., "Searching for MobileNetV3", ICCV
  2019; Zhan et al., "Heterogeneity-Aware Coordination for Federated
  Learning via Stitching Pre-trained blocks" (FedStitch), 2024.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.models import layers
from fedjax_mr.models import model as model_lib

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
RESOLUTION = 224


class Preprocess(NamedTuple):
  """ImageNet input preprocessing of a dataset's model input.

  Attributes:
    size: the square resolution images are resized to.
    scale: the dataset's model input is `x * scale + shift` of stored values
      x in 0–255 (`fedjax_mr.data.datasets.Dataset.scale`).
    shift: see `scale`.
    mean: per-channel mean subtracted from [0, 1] pixels.
    std: per-channel standard deviation divided by.
  """

  size: int = RESOLUTION
  scale: float = 1 / 255
  shift: float = 0.0
  mean: tuple[float, float, float] = IMAGENET_MEAN
  std: tuple[float, float, float] = IMAGENET_STD


def preprocess(x: jax.Array, p: Preprocess) -> jax.Array:
  """`[N, H, W, 1 or 3]` model input → `[N, size, size, 3]` ImageNet input.

  Resizing is bilinear with half-pixel centres and antialiasing when
  shrinking (`jax.image.resize`), as torchvision's `Resize` on tensors.
  """
  if x.shape[-1] not in (1, 3):
    raise ValueError(f'ImageNet models take 1 or 3 channels, not {x.shape}')
  x = (x.astype(jnp.float32) - p.shift) / (p.scale * 255.0)
  n, h, w, _ = x.shape
  if (h, w) != (p.size, p.size):
    x = jax.image.resize(x, (n, p.size, p.size, x.shape[-1]), 'bilinear')
  x = jnp.broadcast_to(x, (n, p.size, p.size, 3))
  return (x - jnp.asarray(p.mean)) / jnp.asarray(p.std)


def max_pool(x: jax.Array, window: int, stride: int, pad: int) -> jax.Array:
  """Square max-pool, padding with -inf (torch's `MaxPool2d`, floor mode)."""
  return nn.max_pool(
    x, (window, window), (stride, stride), ((pad, pad), (pad, pad))
  )


def avg_pool(x: jax.Array, window: int, stride: int) -> jax.Array:
  """Square average pool without padding (torch's `AvgPool2d`)."""
  return nn.avg_pool(x, (window, window), (stride, stride))


def _adaptive_matrix(n_in: int, n_out: int) -> np.ndarray:
  """`[n_out, n_in]` averaging weights of torch's adaptive pooling: output
  i averages inputs floor(i·n_in/n_out) … ceil((i+1)·n_in/n_out) − 1."""
  m = np.zeros((n_out, n_in), np.float32)
  for i in range(n_out):
    lo, hi = (i * n_in) // n_out, -(-(i + 1) * n_in // n_out)
    m[i, lo:hi] = 1.0 / (hi - lo)
  return m


def adaptive_avg_pool(x: jax.Array, size: tuple[int, int]) -> jax.Array:
  """`[N, H, W, C]` → `[N, *size, C]` (torch's `AdaptiveAvgPool2d`)."""
  if x.shape[1:3] == tuple(size):
    return x
  mh = _adaptive_matrix(x.shape[1], size[0])
  mw = _adaptive_matrix(x.shape[2], size[1])
  return jnp.einsum('Hh,nhwc,Ww->nHWc', mh, x, mw)


def batch_norm(x: jax.Array, name: str, eps: float = 1e-5) -> jax.Array:
  """Inference-mode BatchNorm (running statistics in `batch_stats`)."""
  return nn.BatchNorm(use_running_average=True, epsilon=eps, name=name)(x)


def _conv(features, kernel, stride=1, pad=None, bias=False, name=None):
  pad = kernel // 2 if pad is None else pad
  return layers.Conv(
    features,
    (kernel, kernel),
    (stride, stride),
    ((pad, pad), (pad, pad)),
    use_bias=bias,
    name=name,
  )


def make_divisible(v: float, divisor: int = 8) -> int:
  """The channel rounding of the MobileNet papers' reference code: the
  nearest multiple of `divisor` (at least `divisor`), never below 90 % of
  `v`."""
  new = max(divisor, int(v + divisor / 2) // divisor * divisor)
  return new + divisor if new < 0.9 * v else new


_ACTS = {
  None: lambda x: x,
  'RE': nn.relu,
  'HS': jax.nn.hard_swish,
}


def _check_inference(train: bool) -> None:
  if train:
    raise ValueError('the ImageNet pool models run in inference mode only')


# --- Building blocks ---------------------------------------------------------


class Bottleneck(nn.Module):
  """ResNet-50 block: conv1×1-BN-ReLU, conv3×3(stride)-BN-ReLU,
  conv1×1(expansion·planes)-BN, + shortcut, ReLU. The shortcut is
  conv1×1(stride)-BN when the shape changes."""

  planes: int
  stride: int = 1
  expansion: int = 4

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    out = self.planes * self.expansion
    h = nn.relu(batch_norm(_conv(self.planes, 1, name='conv1')(x), 'bn1'))
    h = _conv(self.planes, 3, self.stride, name='conv2')(h)
    h = nn.relu(batch_norm(h, 'bn2'))
    h = batch_norm(_conv(out, 1, name='conv3')(h), 'bn3')
    if self.stride != 1 or x.shape[-1] != out:
      x = _conv(out, 1, self.stride, name='downsample_conv')(x)
      x = batch_norm(x, 'downsample_bn')
    return nn.relu(h + x)


class DenseLayer(nn.Module):
  """DenseNet layer: BN-ReLU-conv1×1(bn_size·growth)-BN-ReLU-conv3×3(growth),
  its output concatenated after its input."""

  growth_rate: int
  bn_size: int = 4

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = nn.relu(batch_norm(x, 'norm1'))
    h = _conv(self.bn_size * self.growth_rate, 1, name='conv1')(h)
    h = nn.relu(batch_norm(h, 'norm2'))
    h = _conv(self.growth_rate, 3, name='conv2')(h)
    return jnp.concatenate([x, h], axis=-1)


class ConvBNAct(nn.Module):
  """conv (optionally grouped, no bias) → BatchNorm(ε) → activation."""

  features: int
  kernel: int
  stride: int = 1
  groups: int = 1
  act: str | None = None
  eps: float = 1e-3

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    pad = (self.kernel - 1) // 2
    if self.groups == 1:
      conv = _conv(self.features, self.kernel, self.stride, pad, name='conv')
    else:
      conv = nn.Conv(
        self.features,
        (self.kernel, self.kernel),
        (self.stride, self.stride),
        ((pad, pad), (pad, pad)),
        feature_group_count=self.groups,
        use_bias=False,
        name='conv',
      )
    return _ACTS[self.act](batch_norm(conv(x), 'bn', self.eps))


class SqueezeExcitation(nn.Module):
  """Global average → conv1×1(squeeze)-ReLU → conv1×1-hard-sigmoid, scaling
  the input's channels."""

  squeeze: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    s = jnp.mean(x, axis=(1, 2), keepdims=True)
    s = nn.relu(_conv(self.squeeze, 1, bias=True, name='fc1')(s))
    s = _conv(x.shape[-1], 1, bias=True, name='fc2')(s)
    return x * jax.nn.hard_sigmoid(s)


class BneckConfig(NamedTuple):
  """One MobileNetV3 inverted-residual block (torchvision's
  `InvertedResidualConfig` at width 1, dilation 1).

  Attributes:
    input_channels: channels in.
    kernel: depthwise kernel size.
    expanded_channels: channels of the depthwise convolution.
    out_channels: channels out.
    use_se: squeeze-and-excitation after the depthwise convolution.
    activation: 'RE' (ReLU) or 'HS' (hard-swish).
    stride: of the depthwise convolution.
  """

  input_channels: int
  kernel: int
  expanded_channels: int
  out_channels: int
  use_se: bool
  activation: str
  stride: int

  @property
  def residual(self) -> bool:
    return self.stride == 1 and self.input_channels == self.out_channels


class InvertedResidual(nn.Module):
  """MobileNetV3 block: [expand conv1×1] → depthwise conv → [SE] → project
  conv1×1 (no activation), + input when `cfg.residual`."""

  cfg: BneckConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.cfg
    h = x
    if c.expanded_channels != c.input_channels:
      h = ConvBNAct(c.expanded_channels, 1, act=c.activation, name='expand')(h)
    h = ConvBNAct(
      c.expanded_channels,
      c.kernel,
      c.stride,
      groups=c.expanded_channels,
      act=c.activation,
      name='depthwise',
    )(h)
    if c.use_se:
      h = SqueezeExcitation(
        make_divisible(c.expanded_channels // 4), name='se'
      )(h)
    h = ConvBNAct(c.out_channels, 1, name='project')(h)
    return h + x if c.residual else h


# --- The five networks -------------------------------------------------------

# AlexNet's convolutions: (kernel, stride, padding, max-pool 3/2 after).
ALEXNET_CONVS = (
  (11, 4, 2, True),
  (5, 1, 2, True),
  (3, 1, 1, False),
  (3, 1, 1, False),
  (3, 1, 1, True),
)
# VGG-16 (configuration D): the convolutions followed by a 2×2 max-pool.
VGG16_POOL_AFTER = (1, 3, 6, 9, 12)

MOBILENET_V3_LARGE = tuple(
  BneckConfig(*s)
  for s in (
    (16, 3, 16, 16, False, 'RE', 1),
    (16, 3, 64, 24, False, 'RE', 2),
    (24, 3, 72, 24, False, 'RE', 1),
    (24, 5, 72, 40, True, 'RE', 2),
    (40, 5, 120, 40, True, 'RE', 1),
    (40, 5, 120, 40, True, 'RE', 1),
    (40, 3, 240, 80, False, 'HS', 2),
    (80, 3, 200, 80, False, 'HS', 1),
    (80, 3, 184, 80, False, 'HS', 1),
    (80, 3, 184, 80, False, 'HS', 1),
    (80, 3, 480, 112, True, 'HS', 1),
    (112, 3, 672, 112, True, 'HS', 1),
    (112, 5, 672, 160, True, 'HS', 2),
    (160, 5, 960, 160, True, 'HS', 1),
    (160, 5, 960, 160, True, 'HS', 1),
  )
)


class AlexNet(nn.Module):
  """torchvision's AlexNet: five convolutions (`conv0` … `conv4`, ReLU,
  max-pools 3/2 after the 1st, 2nd and 5th), adaptive average pooling to
  `pool_size`², `fc0`-ReLU-`fc1`-ReLU-`fc2`."""

  num_classes: int = 1000
  widths: tuple[int, ...] = (64, 192, 384, 256, 256)
  hidden: int = 4096
  pool_size: int = 6
  preprocess: Preprocess | None = None

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None) -> jax.Array:
    del mask
    _check_inference(train)
    if self.preprocess is not None:
      x = preprocess(x, self.preprocess)
    for i, (w, (k, s, p, pool)) in enumerate(zip(self.widths, ALEXNET_CONVS)):
      x = nn.relu(_conv(w, k, s, p, bias=True, name=f'conv{i}')(x))
      if pool:
        x = max_pool(x, 3, 2, 0)
    x = adaptive_avg_pool(x, (self.pool_size,) * 2)
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(self.hidden, name='fc0')(x))
    x = nn.relu(nn.Dense(self.hidden, name='fc1')(x))
    return nn.Dense(self.num_classes, name='fc2')(x)


class VGG16(nn.Module):
  """torchvision's `vgg16` (no BatchNorm): 13 conv3×3-ReLU (`conv0` …
  `conv12`) with 2×2 max-pools after `VGG16_POOL_AFTER`, adaptive average
  pooling to `pool_size`², `fc0`-ReLU-`fc1`-ReLU-`fc2`."""

  num_classes: int = 1000
  widths: tuple[int, ...] = (64, 64, 128, 128, 256, 256, 256, 512, 512, 512,
                             512, 512, 512)  # fmt: skip
  hidden: int = 4096
  pool_size: int = 7
  preprocess: Preprocess | None = None

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None) -> jax.Array:
    del mask
    _check_inference(train)
    if len(self.widths) != 13:
      raise ValueError(f'VGG-16 has 13 convolutions, got {self.widths}')
    if self.preprocess is not None:
      x = preprocess(x, self.preprocess)
    for i, w in enumerate(self.widths):
      x = nn.relu(_conv(w, 3, bias=True, name=f'conv{i}')(x))
      if i in VGG16_POOL_AFTER:
        x = layers.max_pool_2x2(x)
    x = adaptive_avg_pool(x, (self.pool_size,) * 2)
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(self.hidden, name='fc0')(x))
    x = nn.relu(nn.Dense(self.hidden, name='fc1')(x))
    return nn.Dense(self.num_classes, name='fc2')(x)


class ResNet50(nn.Module):
  """torchvision's ResNet-50: `conv1` 7×7/2-`bn1`-ReLU-max-pool 3/2, stages
  `layer{i}_{j}` of `Bottleneck`s (the first of stages 2–4 with stride 2),
  global average pool, `fc`."""

  num_classes: int = 1000
  stem_width: int = 64
  widths: tuple[int, ...] = (64, 128, 256, 512)
  depths: tuple[int, ...] = (3, 4, 6, 3)
  expansion: int = 4
  preprocess: Preprocess | None = None

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None) -> jax.Array:
    del mask
    _check_inference(train)
    if self.preprocess is not None:
      x = preprocess(x, self.preprocess)
    x = _conv(self.stem_width, 7, 2, 3, name='conv1')(x)
    x = max_pool(nn.relu(batch_norm(x, 'bn1')), 3, 2, 1)
    for i, (planes, depth) in enumerate(zip(self.widths, self.depths)):
      for j in range(depth):
        stride = 2 if i > 0 and j == 0 else 1
        x = Bottleneck(
          planes, stride, self.expansion, name=f'layer{i + 1}_{j}'
        )(x)
    return nn.Dense(self.num_classes, name='fc')(jnp.mean(x, axis=(1, 2)))


class DenseNet121(nn.Module):
  """torchvision's DenseNet-121: `conv0` 7×7/2-`norm0`-ReLU-max-pool 3/2,
  dense blocks of `DenseLayer`s (`denseblock{b}_layer{l}`) joined by
  transitions (`transition{t}_norm`-ReLU-`transition{t}_conv` 1×1 halving
  the channels-average-pool 2/2), `norm5`-ReLU, global average pool,
  `classifier`."""

  num_classes: int = 1000
  growth_rate: int = 32
  block_config: tuple[int, ...] = (6, 12, 24, 16)
  num_init_features: int = 64
  bn_size: int = 4
  preprocess: Preprocess | None = None

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None) -> jax.Array:
    del mask
    _check_inference(train)
    if self.preprocess is not None:
      x = preprocess(x, self.preprocess)
    x = _conv(self.num_init_features, 7, 2, 3, name='conv0')(x)
    x = max_pool(nn.relu(batch_norm(x, 'norm0')), 3, 2, 1)
    for b, n_layers in enumerate(self.block_config):
      for i in range(n_layers):
        x = DenseLayer(
          self.growth_rate, self.bn_size, name=f'denseblock{b + 1}_layer{i + 1}'
        )(x)
      if b + 1 < len(self.block_config):
        x = nn.relu(batch_norm(x, f'transition{b + 1}_norm'))
        x = _conv(x.shape[-1] // 2, 1, name=f'transition{b + 1}_conv')(x)
        x = avg_pool(x, 2, 2)
    x = nn.relu(batch_norm(x, 'norm5'))
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, name='classifier')(x)


class MobileNetV3Large(nn.Module):
  """torchvision's `mobilenet_v3_large`: `stem` conv3×3/2-BN-hard-swish, the
  `InvertedResidual` blocks `block1` … `block{n}`, `last_conv` 1×1 to 6 ×
  the last block's channels (hard-swish), global average pool,
  `fc0`-hard-swish-`fc1`."""

  num_classes: int = 1000
  settings: tuple[BneckConfig, ...] = MOBILENET_V3_LARGE
  last_channel: int = 1280
  preprocess: Preprocess | None = None

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None) -> jax.Array:
    del mask
    _check_inference(train)
    settings = tuple(BneckConfig(*s) for s in self.settings)
    if self.preprocess is not None:
      x = preprocess(x, self.preprocess)
    x = ConvBNAct(settings[0].input_channels, 3, 2, act='HS', name='stem')(x)
    for i, cfg in enumerate(settings):
      x = InvertedResidual(cfg, name=f'block{i + 1}')(x)
    last = 6 * settings[-1].out_channels
    x = ConvBNAct(last, 1, act='HS', name='last_conv')(x)
    x = jnp.mean(x, axis=(1, 2))
    x = jax.nn.hard_swish(nn.Dense(self.last_channel, name='fc0')(x))
    return nn.Dense(self.num_classes, name='fc1')(x)


# torchvision's builder name → module class.
ARCHITECTURES = {
  'alexnet': AlexNet,
  'resnet50': ResNet50,
  'vgg16': VGG16,
  'densenet121': DenseNet121,
  'mobilenet_v3_large': MobileNetV3Large,
}
PREFIX = 'imagenet_'  # model names are PREFIX + architecture


def arch_of(model_name: str) -> str | None:
  """The architecture of an ImageNet model name ('imagenet_vgg16' →
  'vgg16'), or None for other models."""
  if model_name.startswith(PREFIX) and model_name[len(PREFIX) :] in (
    ARCHITECTURES
  ):
    return model_name[len(PREFIX) :]
  return None


def module(
  arch: str,
  config: dict[str, Any] | None = None,
  preprocessing: Preprocess | None = None,
) -> nn.Module:
  """The Flax module of `arch` with constructor arguments `config` (lists
  become tuples; MobileNet settings become `BneckConfig`s) and input
  `preprocessing`."""
  config = dict(config or {})
  for k, v in config.items():
    if isinstance(v, list):
      config[k] = tuple(tuple(e) if isinstance(e, list) else e for e in v)
  if 'settings' in config:
    config['settings'] = tuple(BneckConfig(*s) for s in config['settings'])
  return ARCHITECTURES[arch](**config, preprocess=preprocessing)


def model(
  arch: str,
  config: dict[str, Any] | None = None,
  preprocessing: Preprocess | None = None,
  input_shape: tuple[int, ...] | None = None,
) -> model_lib.Model:
  """`arch` as a zoo `Model` named `imagenet_<arch>`.

  Args:
    arch: a key of `ARCHITECTURES`.
    config: constructor arguments (default: torchvision's ImageNet model).
    preprocessing: input preprocessing, or None (the input is already an
      ImageNet-normalised `[N, H, W, 3]` image).
    input_shape: one example's shape; default: the dataset-free
      `(size, size, 3)` at the preprocessing's (or ImageNet's) resolution.
  """
  mod = module(arch, config, preprocessing)
  if input_shape is None:
    size = preprocessing.size if preprocessing is not None else RESOLUTION
    input_shape = (size, size, 3)
  return model_lib.Model(
    PREFIX + arch, mod, tuple(input_shape), int(mod.num_classes)
  )
