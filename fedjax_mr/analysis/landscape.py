"""The loss landscape around a model, along two filter-normalised directions.

The surface f(a, b) = loss(w + a·d1 + b·d2) on a square grid of (a, b),
where d1 and d2 are random Gaussian directions rescaled filter by filter
to the norms of the model's own filters, so that the picture does not
depend on the scale of the weights (which BatchNorm or ReLU networks can
change without changing the function). As in the paper, a direction is
zero in every parameter with at most one dimension (biases, BatchNorm
scales and offsets) and in every collection besides 'params' (BatchNorm
running statistics stay the model's).

What a filter is, in flax's layouts: the slice along the last axis of a
kernel (a convolution's output channel in HWIO, a Dense or LSTM kernel's
output unit in `[in, out]`), which is the slice along the first axis of
the same kernel in PyTorch's layout; and a row of an embedding table
(`nn.Embed`'s 'embedding', `[vocab, dim]`, laid out as in PyTorch).

References:
  Li, Xu, Taylor, Studer and Goldstein, "Visualizing the Loss Landscape of
  Neural Nets", NeurIPS 2018 (Section 4, filter normalisation; Section 5,
  2-D contour plots).
"""

from __future__ import annotations

import math
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fedjax_mr.core import errors
from fedjax_mr.core import types
from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.models import model as model_lib
from fedjax_mr.pipeline import checks
from fedjax_mr.training import evaluation

# Added to a direction filter's norm before dividing by it (as the paper's
# code does), so that a zero filter stays zero.
EPS = 1e-10


def _filter_axis(path: tuple) -> int:
  """The axis that indexes a kernel's filters (see the module docstring)."""
  name = getattr(path[-1], 'key', None) if path else None
  return 0 if name == 'embedding' else -1


def normalize_filters(
  direction: types.PyTree, weights: types.PyTree
) -> types.PyTree:
  """Rescales each filter of `direction` to the norm of the same filter of
  `weights`; leaves with at most one dimension become zero.

  For a kernel leaf and each filter j (the slice along its filter axis),
  d_j <- d_j · ||w_j|| / (||d_j|| + EPS), norms over all of the filter's
  other entries.

  Args:
    direction: a tree like `weights` (a model's 'params').
    weights: the model's parameters.

  Returns:
    The normalised direction, same structure, shapes and dtypes.

  References:
    Li et al., "Visualizing the Loss Landscape of Neural Nets", NeurIPS
    2018, Section 4 (filter normalisation, biases and BatchNorm parameters
    set to zero).
  """

  def one(path, d, w):
    if d.ndim <= 1:
      return jnp.zeros_like(d)
    axis = _filter_axis(path) % d.ndim
    others = tuple(i for i in range(d.ndim) if i != axis)
    d32, w32 = d.astype(jnp.float32), w.astype(jnp.float32)
    d_norm = jnp.sqrt(jnp.sum(d32 * d32, axis=others, keepdims=True))
    w_norm = jnp.sqrt(jnp.sum(w32 * w32, axis=others, keepdims=True))
    return (d32 * (w_norm / (d_norm + EPS))).astype(d.dtype)

  return jax.tree_util.tree_map_with_path(one, direction, weights)


def random_direction(
  key: jax.Array, variables: types.Variables
) -> types.Variables:
  """A filter-normalised Gaussian direction in the space of `variables`.

  Every 'params' leaf gets independent standard normal entries (one key
  per leaf, split from `key` in flatten order), then `normalize_filters`;
  every other collection (BatchNorm statistics) gets zeros.

  Returns:
    A tree like `variables`.
  """
  params = variables['params']
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, max(len(leaves), 1))
  noise = jax.tree.unflatten(
    treedef,
    [
      jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype)
      for k, x in zip(keys, leaves)
    ],
  )
  out = {
    name: jax.tree.map(jnp.zeros_like, tree) for name, tree in variables.items()
  }
  out['params'] = normalize_filters(noise, params)
  return out


def grid_coordinates(steps: int, extent: float) -> np.ndarray:
  """`[steps]` coordinates from -extent to extent, evenly spaced; with an
  odd number of steps the middle one is exactly 0 (the model itself)."""
  if steps < 2:
    raise ValueError(f'steps must be >= 2, got {steps}')
  half = (steps - 1) / 2
  return extent * (np.arange(steps) - half) / half


def grid_points(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
  """`[len(ys) * len(xs), 2]` float32 points (a, b), row by row: point
  `i * len(xs) + j` is `(xs[j], ys[i])`."""
  a, b = np.meshgrid(xs, ys)
  return np.stack([a.ravel(), b.ravel()], axis=1).astype(np.float32)


def make_surface(
  model: model_lib.Model, points_per_pass: int = 1
) -> Callable[..., dict[str, jax.Array]]:
  """Builds `surface(variables, d1, d2, points, data)`: the loss and
  accuracy of `variables + a·d1 + b·d2` at every point (a, b).

  `points_per_pass` points are evaluated at once (vmapped), one pass after
  another (`lax.map`); within a point, the batches of examples run one
  after another (`evaluation.make_evaluate`), so memory is that of
  `points_per_pass` evaluations of one batch. Jit the result.

  One point per pass is the fastest on XLA:CPU: vmapping over the weights
  turns every convolution into a grouped one, which runs about 3× slower
  there (cnn_mnist, 16 points × 1,000 examples: 1.5 s with 1 per pass,
  4.8 s with 4 or 16). On an accelerator, several points per pass keep a
  small model's evaluation from leaving most of the device idle.

  Args:
    model: the model.
    points_per_pass: P, points evaluated together.

  Returns:
    `surface(variables, d1, d2, points [G, 2], data: EvalData) ->
    {'loss': [G], 'accuracy': [G]}`, inference mode (BatchNorm running
    statistics), padded examples masked out.
  """
  evaluate = evaluation.make_evaluate(model)

  def surface(variables, d1, d2, points, data):
    def at(point):
      shifted = jax.tree.map(
        lambda w, u, v: (w + point[0] * u + point[1] * v).astype(w.dtype),
        variables,
        d1,
        d2,
      )
      return evaluate(shifted, data)

    if points_per_pass == 1:
      return lax.map(at, points)
    return lax.map(at, points, batch_size=int(points_per_pass))

  return surface


def subset(
  x: np.ndarray, y: np.ndarray, num_examples: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
  """`num_examples` examples drawn without replacement (seeded, kept in
  their order), or all of them for 0 or at least `len(x)`."""
  if num_examples <= 0 or num_examples >= len(x):
    return x, y
  rng = np.random.default_rng(seed)
  keep = np.sort(rng.choice(len(x), num_examples, replace=False))
  return x[keep], y[keep]


def to_json(values: Any, shape: tuple[int, int]) -> list[list[Any]]:
  """A `[G]` array as `shape` nested lists, None where non-finite."""
  a = np.asarray(values, np.float64).reshape(shape)
  return [[float(v) if np.isfinite(v) else None for v in row] for row in a]


SPLITS = ('test', 'train')
# Bounds checked before anything is computed: the grid's points are held
# at once (steps² of them), and coordinates must stay plottable.
MAX_STEPS = 1001
MAX_EXTENT = 1e6


def check_args(
  *,
  steps: int,
  extent: float,
  num_examples: int,
  split: str,
  seed: int,
  points_per_pass: int,
) -> None:
  """Raises `ConfigError` naming (in backticks) a bad argument of `compute`
  or `examples`."""
  if steps < 3 or steps % 2 == 0 or steps > MAX_STEPS:
    raise errors.ConfigError(
      f'`steps` must be odd, >= 3 (the model is the middle point) and <= '
      f'{MAX_STEPS} (a grid of {MAX_STEPS}² model evaluations), got {steps}'
    )
  if not (math.isfinite(extent) and 0 < extent <= MAX_EXTENT):
    raise errors.ConfigError(
      f'`extent` must be > 0 and <= {MAX_EXTENT:g} (coordinates are in '
      f"units of the model's own filter norms), got {extent}"
    )
  if num_examples < 0:
    raise errors.ConfigError(
      f'`num_examples` must be >= 0 (0: all), got {num_examples}'
    )
  if split not in SPLITS:
    raise errors.ConfigError(
      f'`split` must be one of {", ".join(SPLITS)}, got {split!r}'
    )
  checks.check_seed('seed', seed)
  if points_per_pass < 1:
    raise errors.ConfigError(
      f'`points_per_pass` must be >= 1, got {points_per_pass}'
    )


def examples(
  config: Any, split: str, num_examples: int, seed: int
) -> client_data_lib.EvalData:
  """A run's test or training examples as `EvalData` (one device).

  The dataset is loaded as the run loaded it (`config`: dataset, data
  folder, natural clients); 'train' is its training split. `num_examples`
  > 0 keeps a seeded subset (`subset`).
  """
  from fedjax_mr.pipeline import build

  dataset = build.load_dataset(config)
  if split == 'train':
    x, y = dataset.x_train, dataset.y_train
  else:
    x, y = dataset.x_test, dataset.y_test
  x, y = subset(x, y, num_examples, seed)
  return client_data_lib.eval_data(
    x, y, config.evaluation.eval_batch_size, dataset.scale, dataset.shift
  )


def compute(
  run: Any,
  data: client_data_lib.EvalData,
  *,
  steps: int = 21,
  extent: float = 1.0,
  seed: int = 0,
  points_per_pass: int = 1,
) -> dict[str, Any]:
  """The landscape around a finished run's global model (jit-compiled).

  Args:
    run: `experiment.load_run(workdir)`; the model is the one the run
      evaluated (`types.evaluated_model`, e.g. FedExP's average of its
      last two iterates).
    data: the examples (`examples`).
    steps: grid points per axis (odd: the model is the middle one).
    extent: coordinates run from -extent to extent.
    seed: the two directions are `random_direction` of the two halves of
      `jax.random.split(jax.random.key(seed))`.
    points_per_pass: see `make_surface`.

  Returns:
    A JSON-ready dict: 'x', 'y' (`[steps]`), 'loss' and 'accuracy'
    (`[steps][steps]`, row i is y[i]; None where non-finite), 'center'
    ({'loss', 'accuracy'} of the model itself), 'round', 'num_examples',
    'seed', 'steps', 'extent'.
  """
  from fedjax_mr.pipeline import build

  config = run.config
  server = jax.device_get(run.state.server)
  algorithm = build.build_algorithm(config, run.model, server.params)
  variables = types.evaluated_model(algorithm, server)
  k1, k2 = jax.random.split(jax.random.key(seed))
  d1 = random_direction(k1, variables)
  d2 = random_direction(k2, variables)
  xs = grid_coordinates(steps, extent)
  surface = jax.jit(make_surface(run.model, points_per_pass))
  out = jax.device_get(
    surface(variables, d1, d2, jnp.asarray(grid_points(xs, xs)), data)
  )
  shape = (steps, steps)
  loss, accuracy = to_json(out['loss'], shape), to_json(out['accuracy'], shape)
  middle = steps // 2
  return {
    'x': xs.tolist(),
    'y': xs.tolist(),
    'loss': loss,
    'accuracy': accuracy,
    'center': {
      'loss': loss[middle][middle],
      'accuracy': accuracy[middle][middle],
    },
    'round': int(run.round),
    'num_examples': int(jnp.sum(data.mask)),
    'seed': int(seed),
    'steps': int(steps),
    'extent': float(extent),
  }
