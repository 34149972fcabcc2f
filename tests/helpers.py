"""Tiny models and data shared by the tests."""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.data import client_data
from fedjax_mr.models import model as model_lib
from fedjax_mr.training import config as config_lib


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


def tree_allclose(a, b, **kw):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **kw), a, b)


def tree_equal(a, b):
  jax.tree.map(lambda u, v: np.testing.assert_array_equal(u, v), a, b)


__all__ = ['Linear', 'linear_model', 'toy_data', 'tree_allclose', 'jnp']


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
  return config_lib.ExperimentConfig(**values)


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
