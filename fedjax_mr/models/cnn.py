"""The small CNNs of the FedMR / FedMut papers and of FedAvg.

Shapes follow the authors' reference code (see the project notes); all use
the CPU-friendly `layers.Conv` and `layers.max_pool_2x2`. Inputs are NHWC.

References:
  McMahan et al., "Communication-Efficient Learning of Deep Networks from
  Decentralized Data", AISTATS 2017 (cnn_fedavg).
"""

from __future__ import annotations

import flax.linen as nn
import jax

from fedjax_mr.models import layers


class SmallCNN(nn.Module):
  """Two 5×5 convolutions, each with 2×2 max pooling and ReLU, then ReLU
  dense layers and a linear head (the representation is the head's input).

  Attributes:
    num_classes: C.
    convs: the two convolutions' output channels.
    hidden: the dense layers' widths.
    padding: the convolutions' padding, 'VALID' or 'SAME'.
    pool_first: pool then ReLU (else ReLU then pool); the values are the
      same, the papers' code orders them differently.
  """

  num_classes: int
  convs: tuple[int, ...] = ()
  hidden: tuple[int, ...] = ()
  padding: str = 'VALID'
  pool_first: bool = True

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
    del train, mask
    if not from_features:
      for features in self.convs:
        y = layers.Conv(features, (5, 5), padding=self.padding)(x)
        if self.pool_first:
          x = nn.relu(layers.max_pool_2x2(y))
        else:
          x = layers.max_pool_2x2(nn.relu(y))
      x = x.reshape(x.shape[0], -1)
      for width in self.hidden:
        x = nn.relu(nn.Dense(width)(x))
      if features_only:
        return x
    return nn.Dense(self.num_classes, name=f'Dense_{len(self.hidden)}')(x)


class CNNMnist(SmallCNN):
  """conv5×5(20) pool ReLU, conv5×5(50) pool ReLU, fc50 ReLU, fc(C).

  66,130 parameters for 28×28×1 inputs and C = 10.
  """

  convs: tuple[int, ...] = (20, 50)
  hidden: tuple[int, ...] = (50,)


class CNNCifar(SmallCNN):
  """conv5×5(6) ReLU pool, conv5×5(16) ReLU pool, fc120, fc84, fc(C).

  62,006 parameters for 32×32×3 inputs and C = 10.
  """

  convs: tuple[int, ...] = (6, 16)
  hidden: tuple[int, ...] = (120, 84)
  pool_first: bool = False


class CNNFemnist(SmallCNN):
  """conv5×5(16) pool ReLU, conv5×5(32) pool ReLU, fc256 ReLU, fc(C).

  160,510 parameters for 28×28×1 inputs and C = 62.
  """

  convs: tuple[int, ...] = (16, 32)
  hidden: tuple[int, ...] = (256,)


class CNNFedAvg(SmallCNN):
  """McMahan et al.'s CNN: conv5×5(32) pool, conv5×5(64) pool ('same'),
  fc512 ReLU, fc(C); 1,663,370 parameters for 28×28×1 and C = 10."""

  convs: tuple[int, ...] = (32, 64)
  hidden: tuple[int, ...] = (512,)
  padding: str = 'SAME'
  pool_first: bool = False
