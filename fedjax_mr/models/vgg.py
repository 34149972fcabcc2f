"""VGG-16 with BatchNorm for small images (FedMR, FedMut), NHWC.

13 × [conv3×3 ('same', with bias) → BatchNorm → ReLU] in the pattern 64, 64,
M, 128, 128, M, 256 ×3, M, 512 ×3, M, 512 ×3, M (M: 2×2 max-pool), then
flatten(512) → dense 4096 → ReLU → Dropout(0.5) → dense 4096 → ReLU →
Dropout(0.5) → dense C. 33,646,666 parameters for 32×32×3 and C = 10, as
PyTorch counts them (BN scale and bias are parameters, running statistics
are `batch_stats`).

The classifier takes the 512 channels of a 1×1 map, which 32×32 inputs
reach after five pools. Smaller inputs (28×28 FEMNIST) would run out of
pixels (28 → 14 → 7 → 3 → 1 → 0), so a pool of an odd-sized map rounds up
(PyTorch's `ceil_mode=True`: 28 → 14 → 7 → 4 → 2 → 1) and the parameter
count stays that of the reference apart from the first convolution's input
channels. Inputs larger than 32×32 are pooled to 1×1 by a global max after
the last pool. Both are our choices; the reference only takes 32×32.

Dropout draws from the 'dropout' rng that `Model.apply_train` passes and is
off in evaluation.

References:
  Simonyan & Zisserman, "Very Deep Convolutional Networks for Large-Scale
  Image Recognition", ICLR 2015; Hu et al., "FedMR: Federated Learning via
  Model Recombination"; Hu et al., "FedMut: Generalized Federated Learning
  via Stochastic Mutation", AAAI 2024.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_mr.models import layers

# Output channels of the 13 convolutions; 'M' is a 2×2 max-pool.
VGG16_PATTERN = (
  64, 64, 'M', 128, 128, 'M', 256, 256, 256, 'M',
  512, 512, 512, 'M', 512, 512, 512, 'M',
)  # fmt: skip


def max_pool_2x2_ceil(x: jax.Array) -> jax.Array:
  """2×2 stride-2 max-pool that keeps an odd last row/column (ceil mode)."""
  h, w = x.shape[1], x.shape[2]
  if h % 2 or w % 2:
    x = jnp.pad(
      x,
      ((0, 0), (0, h % 2), (0, w % 2), (0, 0)),
      constant_values=-jnp.inf,
    )
  return layers.max_pool_2x2(x)


class VGG16(nn.Module):
  """VGG-16 with BatchNorm, a 512 → 4096 → 4096 → C classifier.

  Attributes:
    num_classes: C.
    dropout_rate: of the two classifier dropouts (0.5 in the reference).
  """

  num_classes: int
  dropout_rate: float = 0.5

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
      i = 0
      for v in VGG16_PATTERN:
        if v == 'M':
          x = max_pool_2x2_ceil(x)
          continue
        x = layers.Conv(v, (3, 3), padding=((1, 1), (1, 1)), name=f'conv{i}')(x)
        x = nn.relu(layers.batch_norm(x, train, mask, f'bn{i}'))
        i += 1
      x = jnp.max(x, axis=(1, 2))  # [B, 512]; the identity on a 1×1 map
      for j in range(2):
        x = nn.relu(nn.Dense(4096, name=f'fc{j}')(x))
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
      if features_only:
        return x
    return nn.Dense(self.num_classes, name='fc2')(x)
