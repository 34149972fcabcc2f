"""A Flax module wrapped with the few pure functions the engine needs."""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_mr.core import errors
from fedjax_mr.core import types
from fedjax_mr.models import cnn


class Model(NamedTuple):
  """A classifier and how to call it.

  Attributes:
    name: registry name.
    module: a Flax linen module called as `module(x, train=..., mask=...)`
      (`mask`: `[B]` real-example mask or None, used by BatchNorm).
    input_shape: one example's shape, e.g. `(28, 28, 1)`.
    num_classes: number of logits.
  """

  name: str
  module: nn.Module
  input_shape: tuple[int, ...]
  num_classes: int

  def init(self, key: jax.Array) -> types.Variables:
    """Initial variables: `{'params': ...}` plus e.g. `'batch_stats'`."""
    params_key, dropout_key = jax.random.split(key)
    x = jnp.zeros((1, *self.input_shape), jnp.float32)
    variables = self.module.init(
      {'params': params_key, 'dropout': dropout_key}, x, train=False
    )
    return dict(variables)

  def apply_train(
    self,
    variables: types.Variables,
    x: jax.Array,
    key: jax.Array,
    mask: jax.Array | None = None,
  ) -> tuple[jax.Array, types.Variables]:
    """Training-mode forward pass (dropout on, BatchNorm batch statistics).

    Args:
      variables: model variables.
      x: `[B, ...]` inputs.
      key: dropout key.
      mask: optional `[B]` float mask of real examples; modules with
        BatchNorm exclude the others from their batch statistics (a client's
        last, partial batch is padded to B).

    Returns:
      `(logits [B, C], state)` where `state` holds the updated non-parameter
      collections (e.g. `batch_stats`; empty for models without any).
    """
    mutable = [k for k in variables if k != 'params']
    kwargs = dict(train=True, mask=mask, rngs={'dropout': key})
    if not mutable:
      return self.module.apply(variables, x, **kwargs), {}
    logits, state = self.module.apply(variables, x, mutable=mutable, **kwargs)
    return logits, dict(state)

  def apply_eval(self, variables: types.Variables, x: jax.Array) -> jax.Array:
    """Inference-mode forward pass: logits `[B, C]`."""
    return self.module.apply(variables, x, train=False)


_ZOO = {
  'cnn_mnist': cnn.CNNMnist,
  'cnn_cifar': cnn.CNNCifar,
  'cnn_femnist': cnn.CNNFemnist,
  'cnn_fedavg': cnn.CNNFedAvg,
}

# Input shapes each model accepts: (H, W, C) image models need rank-3 input
# at least 28×28 (two 5×5 'valid' convs with pooling need ≥ 12×12).
NAMES = tuple(sorted(_ZOO))


def get(name: str, num_classes: int, input_shape: tuple[int, ...]) -> Model:
  """Returns the model `name` for a dataset's classes and example shape.

  Raises:
    ConfigError: unknown name, or a dataset this model cannot take.
  """
  if name not in _ZOO:
    raise errors.ConfigError(
      f'--model: unknown model {name!r}; choose one of {", ".join(NAMES)}'
    )
  input_shape = tuple(int(d) for d in input_shape)
  if len(input_shape) != 3 or min(input_shape[:2]) < 16:
    raise errors.ConfigError(
      f'--model={name} needs images of shape (H, W, C) with H, W ≥ 16; the '
      f'dataset gives examples of shape {input_shape}'
    )
  if num_classes < 2:
    raise errors.ConfigError(
      f'a classifier needs ≥ 2 classes, got {num_classes}'
    )
  return Model(
    name, _ZOO[name](num_classes=num_classes), input_shape, num_classes
  )
