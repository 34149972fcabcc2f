"""Zoo models with random weights for the FedStitch tests (cached).

`Model.init` costs seconds per model on a small CPU (it compiles the
initialisers), so the tests fill the variables' abstract shapes with seeded
numpy values instead: kernels scaled by 1/sqrt(fan-in), small biases,
BatchNorm statistics with positive variances. The blocks see the same
structure, names and shapes as with `init`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr import models
from fedjax_mr.stitch import blocks
from fedjax_mr.stitch import pool as pool_lib

IMAGE = (28, 28, 1)
TOKENS = (80,)

# (zoo name, classes, input shape) of the models whose blocks are run.
SMALL_ZOO = (
  ('cnn_mnist', 10, IMAGE),
  ('cnn_cifar', 10, IMAGE),
  ('cnn_fedavg', 10, IMAGE),
  ('cnn_femnist', 10, IMAGE),
  ('resnet20', 10, IMAGE),
  ('char_lstm', 80, TOKENS),
)


def _leaf(rng: np.random.Generator, path, shape) -> np.ndarray:
  name = path[-1].key
  if name == 'var':
    value = rng.uniform(0.5, 1.5, shape)
  elif name == 'scale':
    value = rng.uniform(0.8, 1.2, shape)
  elif name in ('bias', 'mean', 'b_ih', 'b_hh'):
    value = 0.1 * rng.standard_normal(shape)
  elif name == 'embedding':
    value = rng.standard_normal(shape)
  else:  # kernels: HWIO conv, [D, O] dense, LSTM w_ih / w_hh
    fan_in = int(np.prod(shape[:-1]))
    value = rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)
  return np.asarray(value, np.float32)


def variables(name: str, num_classes: int, shape: tuple, seed: int = 0):
  """Random variables of zoo model `name` (cached: do not modify)."""
  return _variables(name, num_classes, tuple(shape), seed)


@functools.lru_cache(maxsize=None)
def _variables(name, num_classes, shape, seed):
  model = models.get(name, num_classes, shape)
  abstract = jax.eval_shape(model.init, jax.random.key(0))
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
    lambda p, s: jnp.asarray(_leaf(rng, p, s.shape)), dict(abstract)
  )


def model(name: str, num_classes: int, shape: tuple):
  return models.get(name, num_classes, shape)


@functools.lru_cache(maxsize=None)
def apply_eval(name: str, num_classes: int, shape: tuple):
  """The zoo model's jitted inference pass `(variables, x) -> logits`."""
  return jax.jit(models.get(name, num_classes, shape).apply_eval)


def chain(
  name: str,
  num_classes: int = 10,
  shape: tuple = IMAGE,
  style: str = 'default',
  model_id: str | None = None,
  seed: int = 0,
) -> tuple[blocks.Block, ...]:
  """The blocks of a random zoo model (model id defaults to its name)."""
  return _chain(name, num_classes, tuple(shape), style, model_id, seed)


@functools.lru_cache(maxsize=None)
def _chain(name, num_classes, shape, style, model_id, seed):
  return blocks.split(
    model_id or name,
    name,
    variables(name, num_classes, shape, seed),
    shape,
    style,
  )


def inputs(shape: tuple, n: int = 3, seed: int = 1, num_classes: int = 80):
  """A batch of `n` examples: images in [0, 1) or token ids."""
  rng = np.random.default_rng(seed)
  if len(shape) == 1:
    return jnp.asarray(rng.integers(0, num_classes, (n, *shape)), jnp.int32)
  return jnp.asarray(rng.uniform(0, 1, (n, *shape)), jnp.float32)


# --- A pool of shape-only blocks (nothing runs) ---------------------------


def block(model, index, kind, in_spec, out_spec):
  return blocks.Block(model, index, kind, (), (), in_spec, out_spec, {})


def fake_pool():
  """Three 3-block models a, b, c; c's middle block outputs a vector."""
  chains = [
    [
      block(m, 0, 'start', (8, 8, 1), (8, 8, 4)),
      block(m, 1, 'middle', (8, 8, 4), (4, 4, 8)),
      block(m, 2, 'end', (4, 4, 8), (10,)),
    ]
    for m in ('a', 'b')
  ]
  chains.append(
    [
      block('c', 0, 'start', (8, 8, 1), (6, 6, 3)),
      block('c', 1, 'middle', (6, 6, 3), (16,)),
      block('c', 2, 'end', (16,), (10,)),
    ]
  )
  return pool_lib.make_pool(chains)
