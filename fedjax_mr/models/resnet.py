"""The ResNets of the FedMR and FedMut papers (CIFAR-style, NHWC).

* `ResNet20`: the FedMR papers' "ResNet-20", a pre-activation *bottleneck*
  network (not He et al.'s 20-layer basic-block CIFAR ResNet): a 3×3 stem,
  three stages of two bottleneck blocks, global average pooling, one dense
  layer.
* `ResNet18`: the FedMut paper's ResNet-18 for 32×32 inputs: basic blocks
  [2, 2, 2, 2], a 3×3 stride-1 stem and no max-pool.

Shapes and parameter counts are those of the authors' reference code (see
the project notes). Every convolution is the CPU-fast `layers.Conv`; every
BatchNorm is `layers.batch_norm` (statistics in `batch_stats`, PyTorch's
momentum and ε, padded rows of a client's partial last batch excluded).
Modules are created in the order of PyTorch's `state_dict`, which is the
model order FedMR-p cuts into segments.

References:
  He et al., "Identity Mappings in Deep Residual Networks", ECCV 2016
  (pre-activation blocks); He et al., "Deep Residual Learning for Image
  Recognition", CVPR 2016 (ResNet-18); Hu et al., "FedMR: Federated Learning
  via Model Recombination"; Hu et al., "FedMut: Generalized Federated
  Learning via Stochastic Mutation", AAAI 2024.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_mr.models import layers


def _conv(features, kernel, stride=1, name=None):
  pad = kernel // 2
  return layers.Conv(
    features,
    (kernel, kernel),
    strides=(stride, stride),
    padding=((pad, pad), (pad, pad)),
    use_bias=False,
    name=name,
  )


class PreActBottleneck(nn.Module):
  """BN-ReLU-conv1×1, BN-ReLU-conv3×3(stride), BN-ReLU-conv1×1(4·planes).

  The shortcut is the identity, or a 1×1 convolution (stride, no BN) of the
  first pre-activation when the shape changes.
  """

  planes: int
  stride: int = 1
  expansion: int = 4

  @nn.compact
  def __call__(self, x, train, mask):
    out_ch = self.expansion * self.planes
    pre = nn.relu(layers.batch_norm(x, train, mask, 'bn1'))
    h = _conv(self.planes, 1, name='conv1')(pre)
    h = nn.relu(layers.batch_norm(h, train, mask, 'bn2'))
    h = _conv(self.planes, 3, self.stride, name='conv2')(h)
    h = nn.relu(layers.batch_norm(h, train, mask, 'bn3'))
    h = _conv(out_ch, 1, name='conv3')(h)
    # Created after conv3, as the reference registers it (model order).
    if self.stride != 1 or x.shape[-1] != out_ch:
      shortcut = _conv(out_ch, 1, self.stride, name='shortcut')(pre)
    else:
      shortcut = x
    return h + shortcut


class ResNet20(nn.Module):
  """The FedMR papers' "ResNet-20" (pre-activation bottleneck network).

  conv3×3(C_in→16, no bias) → stages of 2 bottleneck blocks with planes
  16/32/64 (outputs 64/128/256 channels) and strides 1/2/2 → global average
  pool → dense(256→C).

  218,970 parameters for 32×32×3 inputs and C = 10 (232,046 for 28×28×1
  and C = 62). The reference also creates a final BatchNorm(256) that its
  forward pass never calls: PyTorch counts 219,482 parameters, 512 more
  (that BN's scale and bias), and the state holds two more 256-long running
  statistics that never change. We leave it out: FedMR and FedMut would
  still average, recombine and mutate its four tensors as four "layers",
  and FedMR-p's segment boundaries would shift, for a module with no effect
  on the output.

  Attributes:
    num_classes: C.
    final_bn_relu: apply BN-ReLU before pooling (the textbook pre-activation
      network; adds those 512 parameters). False, as the reference's forward
      pass, by default.
  """

  num_classes: int
  final_bn_relu: bool = False

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    train: bool = False,
    mask: jax.Array | None = None,
    *,
    features_only: bool = False,
    from_features: bool = False,
  ) -> jax.Array:
    if not from_features:
      x = _conv(16, 3, name='conv1')(x)
      for i, (planes, stride) in enumerate(((16, 1), (32, 2), (64, 2))):
        for j in range(2):
          x = PreActBottleneck(
            planes, stride if j == 0 else 1, name=f'layer{i + 1}_{j}'
          )(x, train, mask)
      if self.final_bn_relu:
        x = nn.relu(layers.batch_norm(x, train, mask, 'bn'))
      x = jnp.mean(x, axis=(1, 2))
      if features_only:
        return x
    return nn.Dense(self.num_classes, name='linear')(x)


class BasicBlock(nn.Module):
  """conv3×3(stride)-BN-ReLU, conv3×3-BN, + shortcut, ReLU.

  The shortcut is the identity, or conv1×1(stride)-BN when the shape
  changes.
  """

  planes: int
  stride: int = 1

  @nn.compact
  def __call__(self, x, train, mask):
    h = _conv(self.planes, 3, self.stride, name='conv1')(x)
    h = nn.relu(layers.batch_norm(h, train, mask, 'bn1'))
    h = _conv(self.planes, 3, name='conv2')(h)
    h = layers.batch_norm(h, train, mask, 'bn2')
    if self.stride != 1 or x.shape[-1] != self.planes:
      x = _conv(self.planes, 1, self.stride, name='shortcut_conv')(x)
      x = layers.batch_norm(x, train, mask, 'shortcut_bn')
    return nn.relu(h + x)


class ResNet18(nn.Module):
  """ResNet-18 for small images (FedMut).

  conv3×3(C_in→64, stride 1, no bias)-BN-ReLU → basic-block stages [2, 2,
  2, 2] with 64/128/256/512 channels and strides 1/2/2/2 → global average
  pool → dense(512→C). 11,173,962 parameters for 32×32×3 and C = 10, as
  PyTorch counts them (BN scale and bias are parameters, running
  statistics are `batch_stats`).

  `width` scales every stage's channels (width, 2·width, 4·width,
  8·width); the zoo's `resnet18_w16` is the quarter-width network (16
  channels first, 701,178 parameters for 28×28×1 and C = 10), a ResNet-18
  that trains in reasonable time on a CPU.
  """

  num_classes: int
  width: int = 64

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    train: bool = False,
    mask: jax.Array | None = None,
    *,
    features_only: bool = False,
    from_features: bool = False,
  ) -> jax.Array:
    if not from_features:
      w = self.width
      x = _conv(w, 3, name='conv1')(x)
      x = nn.relu(layers.batch_norm(x, train, mask, 'bn1'))
      for i, (planes, stride) in enumerate(
        ((w, 1), (2 * w, 2), (4 * w, 2), (8 * w, 2))
      ):
        for j in range(2):
          x = BasicBlock(
            planes, stride if j == 0 else 1, name=f'layer{i + 1}_{j}'
          )(x, train, mask)
      x = jnp.mean(x, axis=(1, 2))
      if features_only:
        return x
    return nn.Dense(self.num_classes, name='linear')(x)
