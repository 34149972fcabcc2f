"""Multinomial logistic regression, the model of the synthetic data.

softmax(x W + b) on flat inputs x `[B, D]`: for the 60 features and 10
classes of Synthetic(α, β), W `[60, 10]` and b `[10]`, 610 parameters.
The representation (the head's input) is the input itself.

References:
  Li et al., "Federated Optimization in Heterogeneous Networks", MLSys
  2020 (its synthetic experiments train this model).
"""

from __future__ import annotations

import flax.linen as nn
import jax


class Logistic(nn.Module):
  """One dense layer from the flat input to the C logits.

  Attributes:
    num_classes: C.
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
    x = x.reshape(x.shape[0], -1)
    if features_only and not from_features:
      return x
    return nn.Dense(self.num_classes, name='Dense_0')(x)
