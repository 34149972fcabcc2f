"""Tiny models and data shared by the tests."""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.data import client_data
from fedjax_mr.models import model as model_lib
from fedjax_mr.pipeline import config as config_lib
from tests import xla_flags


def program_jit(fun, **kwargs):
  """`jax.jit` with a program's fusion emitters (tests/xla_flags.py), for
  the tests that compare two programs bit for bit."""
  return jax.jit(fun, compiler_options=xla_flags.PROGRAM_EMITTERS, **kwargs)


class Linear(nn.Module):
  """Flatten + Dense: a multinomial logistic regression."""

  num_classes: int
  zero_init: bool = False

  @nn.compact
  def __call__(
    self, x, train=False, mask=None, *, features_only=False, from_features=False
  ):
    # The representation is the flattened input (the zoo's split).
    del train, mask
    init = (
      nn.initializers.zeros if self.zero_init else nn.linear.default_kernel_init
    )
    if not from_features:
      x = x.reshape(x.shape[0], -1)
      if features_only:
        return x
    return nn.Dense(self.num_classes, kernel_init=init, name='Dense_0')(x)


def linear_model(num_classes=3, shape=(2, 2, 1), zero_init=False):
  return model_lib.Model(
    'linear', Linear(num_classes, zero_init), shape, num_classes
  )


def toy_data(sizes, shape=(2, 2, 1), num_classes=3, seed=0):
  """ClientData with the given client sizes and random uint8 examples."""
  rng = np.random.default_rng(seed)
  m = sum(sizes)
  x = rng.integers(0, 256, (m, *shape)).astype(np.uint8)
  y = rng.integers(0, num_classes, m).astype(np.int32)
  bounds = np.cumsum([0, *sizes])
  parts = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
  return client_data.from_partition(x, y, parts, scale=1 / 255), (x, y, parts)


# How many units in the last place of the compared dtype a tolerance may
# never go below: two computations whose summation order differs (1 vs 2
# devices, vmapped vs sequential, jitted vs host, im2col vs convolution)
# round differently, by a few ULPs on every CPU's kernels.
ULPS = 4


def _float_dtype(*arrays) -> np.dtype | None:
  """The coarsest floating dtype among `arrays` (None if none is a float)."""
  kinds = [
    np.dtype(a.dtype)
    for a in arrays
    if jnp.issubdtype(np.dtype(a.dtype), jnp.floating)
  ]
  if not kinds:
    return None
  return max(kinds, key=lambda d: float(jnp.finfo(d).eps))


def coarsest_float_dtype(tree) -> np.dtype | None:
  """The coarsest floating dtype among a tree's leaves."""
  return _float_dtype(*(np.asarray(x) for x in jax.tree.leaves(tree)))


def dtype_rtol(rtol: float, *arrays) -> float:
  """`rtol`, or `ULPS` ULPs of the arrays' coarsest float dtype if coarser."""
  dtype = _float_dtype(*arrays)
  if dtype is None:
    return rtol
  return max(rtol, ULPS * float(jnp.finfo(dtype).eps))


def assert_close(
  actual, desired, rtol=1e-7, atol=0.0, err_msg='', precision=None
):
  """`np.testing.assert_allclose` over two trees (or two arrays/scalars),
  with a tolerance that follows the compared leaves' dtype.

  `rtol` is what the caller asks for; a leaf in a coarser dtype (bfloat16,
  float16) gets at least `ULPS` of its own epsilon, so no comparison is
  finer than its dtype can represent. `precision`, a dtype, says that
  every leaf carries that dtype's rounding (a float32 mean of values
  stored in bfloat16): each leaf then gets at least `ULPS` of its epsilon,
  relative and, for elements near zero, relative to the leaf's largest
  magnitude. Both sides are compared in float64, so the subtraction itself
  does not round in the coarse dtype. Every tolerance in the suite goes
  through here (tests/test_tolerances.py).
  """

  def one(u, v):
    u, v = np.asarray(u), np.asarray(v)
    tol, floor = dtype_rtol(rtol, u, v), atol
    if _float_dtype(u, v) is not None:
      u, v = u.astype(np.float64), v.astype(np.float64)
      if precision is not None:
        eps = ULPS * float(jnp.finfo(precision).eps)
        scale = float(np.max(np.abs(v))) if v.size else 0.0
        tol, floor = max(tol, eps), max(atol, eps * scale)
    np.testing.assert_allclose(u, v, rtol=tol, atol=floor, err_msg=err_msg)

  # Lists are values ([1.0, 2.0]), not trees of leaves.
  jax.tree.map(one, actual, desired, is_leaf=lambda x: isinstance(x, list))


def tree_equal(a, b):
  jax.tree.map(lambda u, v: np.testing.assert_array_equal(u, v), a, b)


__all__ = ['Linear', 'linear_model', 'toy_data', 'assert_close', 'jnp']


class LinearBN(nn.Module):
  """Dense → BatchNorm (masked) → ReLU → Dense: a model with batch_stats."""

  num_classes: int

  @nn.compact
  def __call__(
    self, x, train=False, mask=None, *, features_only=False, from_features=False
  ):
    # The representation is the input of the last Dense (the zoo's split).
    if not from_features:
      h = nn.Dense(6, name='Dense_0')(x.reshape(x.shape[0], -1))
      m = None if mask is None else (mask[:, None] > 0)
      h = nn.BatchNorm(use_running_average=not train, momentum=0.8)(h, mask=m)
      x = nn.relu(h)
      if features_only:
        return x
    return nn.Dense(self.num_classes, name='Dense_1')(x)


def linear_bn_model(num_classes=3, shape=(2, 2, 1)):
  return model_lib.Model('linear_bn', LinearBN(num_classes), shape, num_classes)


def small_config(data_dir, **changes):
  """A fast Fashion-MNIST experiment: 10 clients, 4 per round, 1 epoch."""
  return config_lib.ExperimentConfig.from_flat(
    **small_values(data_dir, **changes)
  )


def small_values(data_dir, **changes):
  """`small_config`'s flags, flat (what `compare.configs` takes)."""
  values = dict(
    data_dir=data_dir,
    num_clients=10,
    clients_per_round=4,
    alpha=0.5,
    local_epochs=1,
    rounds=3,
    eval_every=1,
    checkpoint_every=1,
  )
  values.update(changes)
  return values


def run_module(*args: str, timeout: int = 600):
  """Runs `python -m <args>` in the repository root; returns the process."""
  import subprocess
  import sys

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'}
  return subprocess.run(
    [sys.executable, '-m', *args],
    cwd=repo,
    capture_output=True,
    text=True,
    timeout=timeout,
    env=env,
  )


def flip_checkpoint_byte(step_dir: str) -> None:
  """Flips one bit in the middle of the largest array file of a
  checkpoint (`<step_dir>/default/ocdbt.process_0/d/`): damage its digest
  must catch."""
  d = os.path.join(step_dir, 'default', 'ocdbt.process_0', 'd')
  path = max((os.path.join(d, n) for n in os.listdir(d)), key=os.path.getsize)
  data = bytearray(open(path, 'rb').read())
  data[len(data) // 2] ^= 0x01
  with open(path, 'wb') as f:
    f.write(data)
