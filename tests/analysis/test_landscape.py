"""Loss landscapes: filter normalisation, the grid, and the program."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.analysis import landscape
from fedjax_mr.core import errors
from fedjax_mr.data import client_data
from fedjax_mr.pipeline import experiment
from fedjax_mr.runtime import metrics_io
from fedjax_mr.training import evaluation
from tests import fork_server
from tests import helpers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
R2 = 1 / np.sqrt(2)


def test_filter_normalisation_by_hand():
  weights = {
    # Dense [in, out]: filters are the columns, norms 5 and 1.
    'Dense_0': {'kernel': jnp.array([[3.0, 0.0], [4.0, 1.0]]), 'bias': 7.0},
    # Conv HWIO [1, 2, 1, 2]: the filter j is kernel[..., j], norms 5, 2.
    'Conv_0': {'kernel': jnp.array([[[[3.0, 0.0]], [[4.0, 2.0]]]])},
    # Embedding [vocab, dim]: the rows, norms 1 and 2.
    'Embed_0': {'embedding': jnp.array([[1.0, 0.0], [0.0, 2.0]])},
    'BatchNorm_0': {'scale': jnp.array([1.0, 2.0])},
  }
  weights['Dense_0']['bias'] = jnp.array([1.0, 2.0])
  direction = {
    'Dense_0': {
      'kernel': jnp.array([[1.0, 2.0], [0.0, 2.0]]),  # norms 1, 2*sqrt(2)
      'bias': jnp.array([5.0, 5.0]),
    },
    'Conv_0': {'kernel': jnp.array([[[[0.0, 3.0]], [[2.0, 4.0]]]])},
    'Embed_0': {'embedding': jnp.array([[3.0, 4.0], [1.0, 1.0]])},
    'BatchNorm_0': {'scale': jnp.array([3.0, 3.0])},
  }
  out = landscape.normalize_filters(direction, weights)
  helpers.assert_close(
    out['Dense_0']['kernel'], [[5.0, R2], [0.0, R2]], rtol=1e-6
  )
  # Conv filter 0 is (0, 2) -> (0, 5); filter 1 is (3, 4) -> (1.2, 1.6).
  helpers.assert_close(
    out['Conv_0']['kernel'], [[[[0.0, 1.2]], [[5.0, 1.6]]]], rtol=1e-6
  )
  helpers.assert_close(
    out['Embed_0']['embedding'], [[0.6, 0.8], [2 * R2, 2 * R2]], rtol=1e-6
  )
  # Biases and BatchNorm parameters: zero in the direction.
  np.testing.assert_array_equal(out['Dense_0']['bias'], [0.0, 0.0])
  np.testing.assert_array_equal(out['BatchNorm_0']['scale'], [0.0, 0.0])
  # A zero filter stays zero (no division by zero).
  zero = landscape.normalize_filters(
    {'k': jnp.zeros((2, 2))}, {'k': jnp.ones((2, 2))}
  )
  np.testing.assert_array_equal(zero['k'], np.zeros((2, 2)))


def test_random_direction_matches_filter_norms_and_skips_statistics():
  model = helpers.linear_bn_model()
  variables = model.init(jax.random.key(0))
  d = landscape.random_direction(jax.random.key(1), variables)
  assert jax.tree.structure(d) == jax.tree.structure(variables)
  for stat in jax.tree.leaves(d['batch_stats']):
    np.testing.assert_array_equal(stat, 0)
  for name in ('Dense_0', 'Dense_1'):
    kernel = variables['params'][name]['kernel']
    helpers.assert_close(
      np.linalg.norm(d['params'][name]['kernel'], axis=0),
      np.linalg.norm(kernel, axis=0),
      rtol=1e-5,
    )
    np.testing.assert_array_equal(d['params'][name]['bias'], 0)
  np.testing.assert_array_equal(d['params']['BatchNorm_0']['scale'], 0)
  # Another key, another direction; the same key, the same one.
  other = landscape.random_direction(jax.random.key(2), variables)
  again = landscape.random_direction(jax.random.key(1), variables)
  k = ('params', 'Dense_0', 'kernel')
  pick = lambda t: t[k[0]][k[1]][k[2]]  # noqa: E731
  assert not np.allclose(pick(d), pick(other))
  np.testing.assert_array_equal(pick(d), pick(again))


def test_grid_coordinates_put_the_model_in_the_middle():
  xs = landscape.grid_coordinates(5, 0.5)
  helpers.assert_close(xs, [-0.5, -0.25, 0.0, 0.25, 0.5])
  assert landscape.grid_coordinates(21, 1.0)[10] == 0.0
  points = landscape.grid_points(np.array([1.0, 2.0]), np.array([3.0, 4.0]))
  np.testing.assert_array_equal(points, [[1, 3], [2, 3], [1, 4], [2, 4]])


def test_surface_centre_is_the_model_and_each_point_its_shifted_model():
  model = helpers.linear_model()
  variables = model.init(jax.random.key(0))
  _, (x, y, _) = helpers.toy_data([30, 20])
  data = client_data.eval_data(x, y, 16, scale=1 / 255)
  d1 = landscape.random_direction(jax.random.key(1), variables)
  d2 = landscape.random_direction(jax.random.key(2), variables)
  xs = landscape.grid_coordinates(3, 2.0)
  points = landscape.grid_points(xs, xs)
  # 9 points, 4 per pass: the last pass is partial.
  surface = jax.jit(landscape.make_surface(model, points_per_pass=4))
  out = surface(variables, d1, d2, jnp.asarray(points), data)
  assert out['loss'].shape == (9,)
  evaluate = jax.jit(evaluation.make_evaluate(model))
  centre = evaluate(variables, data)
  helpers.assert_close(out['loss'][4], centre['loss'], rtol=1e-6)
  assert out['accuracy'][4] == centre['accuracy']
  for i in (0, 5, 7):  # (-2, -2), (2, 0), (0, 2)
    a, b = points[i]
    shifted = jax.tree.map(lambda w, u, v: w + a * u + b * v, variables, d1, d2)
    helpers.assert_close(
      out['loss'][i], evaluate(shifted, data)['loss'], rtol=1e-5
    )
  # Two filter norms away from the model, the loss is higher.
  assert float(out['loss'][0]) > float(centre['loss'])


def test_subset_is_seeded_and_ordered():
  x, y = np.arange(10) * 10, np.arange(10)
  xs, ys = landscape.subset(x, y, 4, seed=3)
  assert len(xs) == 4 and list(xs) == sorted(xs) and list(xs // 10) == list(ys)
  np.testing.assert_array_equal(landscape.subset(x, y, 4, seed=3)[0], xs)
  assert not np.array_equal(landscape.subset(x, y, 4, seed=4)[0], xs)
  assert landscape.subset(x, y, 0, seed=3)[0] is x


@pytest.mark.parametrize(
  'changes,name',
  [
    ({'steps': 4}, 'steps'),
    ({'steps': 1}, 'steps'),
    ({'extent': float('nan')}, 'extent'),
    ({'num_examples': -1}, 'num_examples'),
    ({'split': 'valid'}, 'split'),
    ({'seed': 2**32}, 'seed'),
    ({'points_per_pass': 0}, 'points_per_pass'),
  ],
)
def test_check_args_names_the_bad_argument(changes, name):
  args = dict(
    steps=3, extent=1.0, num_examples=0, split='test', seed=0, points_per_pass=1
  )
  landscape.check_args(**args)
  with pytest.raises(errors.ConfigError, match=f'^`{name}` must'):
    landscape.check_args(**{**args, **changes})


def test_program_on_a_finished_run(small_fmnist_dir, tmp_path):
  cfg = helpers.small_config(small_fmnist_dir, rounds=2)
  cfg = cfg.replace(algorithm='fedavg')
  work = str(tmp_path / 'run')
  experiment.train_and_evaluate(cfg, work, log=lambda line: None)
  before = sorted(os.listdir(work))
  out = tmp_path / 'out'
  # A process of its own, forked from one that imported the libraries the
  # programs share (tests/fork_server.py); this process's
  # environment.
  proc = fork_server.run_module(
    'experiments.landscape',
    f'--workdir={work}',
    f'--output={out}',
    '--steps=3',
    '--extent=0.5',
    '--num_examples=0',
    '--points_per_pass=4',
    cwd=REPO,
    env=dict(os.environ),
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'FedAvg at round 2' in proc.stdout
  grid = json.loads((out / 'landscape.json').read_text())
  assert grid['x'] == grid['y'] == [-0.5, 0.0, 0.5]
  assert np.shape(grid['loss']) == np.shape(grid['accuracy']) == (3, 3)
  assert grid['round'] == 2 and grid['num_examples'] == 500
  assert grid['split'] == 'test' and grid['algorithm'] == 'fedavg'
  # The centre is the run's own global model on the whole test set.
  last = metrics_io.read(os.path.join(work, 'metrics.jsonl'))[-1]
  helpers.assert_close(grid['center']['loss'], last['test_loss'], 1e-5)
  assert grid['center']['loss'] == grid['loss'][1][1]
  helpers.assert_close(
    grid['center']['accuracy'], last['test_accuracy'], atol=1e-6
  )
  assert min(map(min, grid['loss'])) > 0
  assert (out / 'landscape.png').read_bytes()[:4] == b'\x89PNG'
  # The run's folder is read, never written.
  assert sorted(os.listdir(work)) == before
