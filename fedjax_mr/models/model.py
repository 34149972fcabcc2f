"""A Flax module wrapped with the few pure functions the engine needs."""

from __future__ import annotations

import functools
from typing import Any
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_mr.core import errors
from fedjax_mr.core import types
from fedjax_mr.models import cnn
from fedjax_mr.models import logistic
from fedjax_mr.models import lstm
from fedjax_mr.models import resnet
from fedjax_mr.models import vgg


class Model(NamedTuple):
  """A classifier and how to call it.

  Attributes:
    name: registry name.
    module: a Flax linen module called as `module(x, train=..., mask=...)`
      (`mask`: `[B]` real-example mask or None, used by BatchNorm). Zoo
      modules split at their last layer (the head, a Dense): with
      `features_only=True` they return the representation the head takes,
      with `from_features=True` they apply the head alone to such a
      representation (see `apply_train_features`, `apply_head`).
    input_shape: one example's shape, e.g. `(28, 28, 1)`.
    num_classes: number of logits.
    input_dtype: dtype of the model input (float32 for images; int32 for
      token ids, which may also arrive as uint8).
    compute_dtype: None (the default): compute in the variables' dtype,
      float32. A floating dtype (bfloat16) is a mixed-precision policy: the
      passes cast the float parameters and inputs to it and compute in it,
      while the variables (the master weights the optimizer updates, and
      BatchNorm's running statistics) stay float32; outputs come back as
      float32 and gradients reach the float32 parameters through the cast.
  """

  name: str
  module: nn.Module
  input_shape: tuple[int, ...]
  num_classes: int
  input_dtype: Any = jnp.float32
  compute_dtype: Any = None

  def init(self, key: jax.Array) -> types.Variables:
    """Initial variables: `{'params': ...}` plus e.g. `'batch_stats'`."""
    params_key, dropout_key = jax.random.split(key)
    x = jnp.zeros((1, *self.input_shape), self.input_dtype)
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
    cast, x = self._compute(variables), self._input(x)
    if not mutable:
      return self._output(self.module.apply(cast, x, **kwargs)), {}
    logits, state = self.module.apply(cast, x, mutable=mutable, **kwargs)
    return self._output(logits), _like(dict(state), variables)

  def apply_eval(self, variables: types.Variables, x: jax.Array) -> jax.Array:
    """Inference-mode forward pass: logits `[B, C]`."""
    out = self.module.apply(
      self._compute(variables), self._input(x), train=False
    )
    return self._output(out)

  def apply_train_features(
    self,
    variables: types.Variables,
    x: jax.Array,
    key: jax.Array,
    mask: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array, types.Variables]:
    """`apply_train` that also returns the representation (the input of
    the head), from one pass through the network.

    Returns:
      `(logits [B, C], representation [B, D], state)`, the logits equal to
      `apply_train`'s.
    """
    mutable = [k for k in variables if k != 'params']
    kwargs = dict(
      train=True, mask=mask, rngs={'dropout': key}, features_only=True
    )
    cast, x = self._compute(variables), self._input(x)
    if mutable:
      feats, state = self.module.apply(cast, x, mutable=mutable, **kwargs)
      state = _like(dict(state), variables)
    else:
      feats, state = self.module.apply(cast, x, **kwargs), {}
    feats = self._output(feats)
    return self.apply_head(variables, feats), feats, state

  def apply_features(
    self, variables: types.Variables, x: jax.Array
  ) -> jax.Array:
    """Inference-mode representation (the head's input) `[B, D]`."""
    out = self.module.apply(
      self._compute(variables),
      self._input(x),
      train=False,
      features_only=True,
    )
    return self._output(out)

  def apply_head(
    self, variables: types.Variables, features: jax.Array
  ) -> jax.Array:
    """The head alone on representations `[B, D]`: logits `[B, C]`."""
    out = self.module.apply(
      self._compute(variables),
      self._input(features),
      train=False,
      from_features=True,
    )
    return self._output(out)

  def _compute(self, variables: types.Variables) -> types.Variables:
    """The variables a pass reads: the float parameters in the compute
    dtype under a policy; the other collections (running statistics) as
    they are, so their updates keep float32's precision."""
    if self.compute_dtype is None:
      return variables
    return {**variables, 'params': self._input(variables['params'])}

  def _input(self, tree: Any) -> Any:
    """`tree`'s float leaves in the compute dtype (unchanged without a
    policy); integer leaves (token ids) as they are."""
    if self.compute_dtype is None:
      return tree
    return jax.tree.map(lambda a: _cast_float(a, self.compute_dtype), tree)

  def _output(self, y: jax.Array) -> jax.Array:
    """An output back in float32 under a policy (the loss's dtype)."""
    if self.compute_dtype is None:
      return y
    return _cast_float(y, jnp.float32)

  def feature_dim(self) -> int:
    """D, the size of the representation the head takes."""
    variables = jax.eval_shape(self.init, jax.random.key(0))
    x = jnp.zeros((1, *self.input_shape), self.input_dtype)
    out = jax.eval_shape(
      lambda v: self.module.apply(v, x, train=False, features_only=True),
      variables,
    )
    return int(out.shape[-1])


def _cast_float(a: jax.Array, dtype: Any) -> jax.Array:
  a = jnp.asarray(a)
  return a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a


def _like(state: types.Variables, variables: types.Variables) -> Any:
  """The updated collections `state` in the dtypes of `variables`' (a
  policy computes BatchNorm's statistics in its dtype; they are kept as
  the variables are, so a training loop's carry keeps its dtypes)."""
  return {
    k: jax.tree.map(lambda new, old: new.astype(old.dtype), v, variables[k])
    for k, v in state.items()
  }


class _Entry(NamedTuple):
  module: type[nn.Module]
  # 'images' ([H, W, C]), 'tokens' ([T] integer ids) or 'vectors' ([D]
  # float features)
  takes: str
  min_size: int = 0  # images: smallest H and W


_ZOO = {
  'cnn_mnist': _Entry(cnn.CNNMnist, 'images', 16),
  'cnn_cifar': _Entry(cnn.CNNCifar, 'images', 16),
  'cnn_femnist': _Entry(cnn.CNNFemnist, 'images', 16),
  'cnn_fedavg': _Entry(cnn.CNNFedAvg, 'images', 16),
  'resnet20': _Entry(resnet.ResNet20, 'images', 8),
  'resnet18': _Entry(resnet.ResNet18, 'images', 8),
  'resnet18_w16': _Entry(
    functools.partial(resnet.ResNet18, width=16), 'images', 8
  ),
  'vgg16': _Entry(vgg.VGG16, 'images', 8),
  'char_lstm': _Entry(lstm.CharLSTM, 'tokens'),
  'logistic': _Entry(logistic.Logistic, 'vectors'),
}

NAMES = tuple(sorted(_ZOO))
# What `get(compute_dtype=...)` takes: float32, or a bfloat16 compute
# policy with float32 master weights.
COMPUTE_DTYPES = ('float32', 'bfloat16')


def input_kind(name: str) -> str:
  """What model `name` takes: 'images' (`[H, W, C]`), 'tokens' (`[T]`) or
  'vectors' (`[D]` features)."""
  return _ZOO[name].takes


def get(
  name: str,
  num_classes: int,
  input_shape: tuple[int, ...],
  *,
  dataset: str = '',
  compute_dtype: str = 'float32',
) -> Model:
  """Returns the model `name` for a dataset's classes and example shape.

  Args:
    name: one of `NAMES`.
    num_classes: C (for `char_lstm` also the vocabulary size).
    input_shape: one example's shape: `(H, W, C)` images, `(T,)` tokens or
      `(D,)` vectors.
    dataset: the dataset's name, for error messages only.
    compute_dtype: one of `COMPUTE_DTYPES`: 'float32' (the default) computes
      in float32; 'bfloat16' in bfloat16 with float32 master weights (see
      `Model.compute_dtype`).

  Raises:
    ConfigError: unknown name or compute dtype, or a dataset this model
      cannot take (the message names the `model` and `dataset` fields).
  """
  if compute_dtype not in COMPUTE_DTYPES:
    raise errors.ConfigError(
      f'`compute_dtype`: unknown value {compute_dtype!r}; choose one of '
      f'{", ".join(COMPUTE_DTYPES)}'
    )
  if name not in _ZOO:
    raise errors.ConfigError(
      f'`model`: unknown model {name!r}; choose one of {", ".join(NAMES)}'
    )
  entry = _ZOO[name]
  input_shape = tuple(int(d) for d in input_shape)
  if entry.takes == 'images':
    ok = len(input_shape) == 3 and min(input_shape[:2]) >= entry.min_size
    wants = f'images of shape (H, W, C) with H, W ≥ {entry.min_size}'
  elif entry.takes == 'vectors':
    ok = len(input_shape) == 1
    wants = 'vectors of shape (D,)'
  else:
    ok = len(input_shape) == 1
    wants = 'token sequences of shape (T,)'
  if not ok:
    given = 'token sequences' if len(input_shape) == 1 else 'examples'
    raise errors.ConfigError(
      f'`model={name}` takes {wants}; `dataset'
      f'{"=" + dataset if dataset else ""}` gives {given} of shape '
      f'{input_shape}'
    )
  if num_classes < 2:
    raise errors.ConfigError(
      f'a classifier needs ≥ 2 classes, got {num_classes}'
    )
  dtype = jnp.int32 if entry.takes == 'tokens' else jnp.float32
  return Model(
    name,
    entry.module(num_classes=num_classes),
    input_shape,
    num_classes,
    dtype,
    None if compute_dtype == 'float32' else jnp.dtype(compute_dtype),
  )
