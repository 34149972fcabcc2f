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


class CNNMnist(nn.Module):
  """conv5×5(20) pool ReLU, conv5×5(50) pool ReLU, fc50 ReLU, fc(C).

  66,130 parameters for 28×28×1 inputs and C = 10.
  """

  num_classes: int

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
      x = nn.relu(
        layers.max_pool_2x2(layers.Conv(20, (5, 5), padding='VALID')(x))
      )
      x = nn.relu(
        layers.max_pool_2x2(layers.Conv(50, (5, 5), padding='VALID')(x))
      )
      x = x.reshape(x.shape[0], -1)
      x = nn.relu(nn.Dense(50)(x))
      if features_only:
        return x
    return nn.Dense(self.num_classes, name='Dense_1')(x)


class CNNCifar(nn.Module):
  """conv5×5(6) ReLU pool, conv5×5(16) ReLU pool, fc120, fc84, fc(C).

  62,006 parameters for 32×32×3 inputs and C = 10.
  """

  num_classes: int

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
      x = layers.max_pool_2x2(
        nn.relu(layers.Conv(6, (5, 5), padding='VALID')(x))
      )
      x = layers.max_pool_2x2(
        nn.relu(layers.Conv(16, (5, 5), padding='VALID')(x))
      )
      x = x.reshape(x.shape[0], -1)
      x = nn.relu(nn.Dense(120)(x))
      x = nn.relu(nn.Dense(84)(x))
      if features_only:
        return x
    return nn.Dense(self.num_classes, name='Dense_2')(x)


class CNNFemnist(nn.Module):
  """conv5×5(16) pool ReLU, conv5×5(32) pool ReLU, fc256 ReLU, fc(C).

  160,510 parameters for 28×28×1 inputs and C = 62.
  """

  num_classes: int

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
      x = nn.relu(
        layers.max_pool_2x2(layers.Conv(16, (5, 5), padding='VALID')(x))
      )
      x = nn.relu(
        layers.max_pool_2x2(layers.Conv(32, (5, 5), padding='VALID')(x))
      )
      x = x.reshape(x.shape[0], -1)
      x = nn.relu(nn.Dense(256)(x))
      if features_only:
        return x
    return nn.Dense(self.num_classes, name='Dense_1')(x)


class CNNFedAvg(nn.Module):
  """McMahan et al.'s CNN: conv5×5(32) pool, conv5×5(64) pool ('same'),
  fc512 ReLU, fc(C); 1,663,370 parameters for 28×28×1 and C = 10."""

  num_classes: int

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
      x = layers.max_pool_2x2(
        nn.relu(layers.Conv(32, (5, 5), padding='SAME')(x))
      )
      x = layers.max_pool_2x2(
        nn.relu(layers.Conv(64, (5, 5), padding='SAME')(x))
      )
      x = x.reshape(x.shape[0], -1)
      x = nn.relu(nn.Dense(512)(x))
      if features_only:
        return x
    return nn.Dense(self.num_classes, name='Dense_1')(x)
