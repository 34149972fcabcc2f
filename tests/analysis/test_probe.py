"""The stitch runs' kNN probe on a training run's trunk
(`fedjax_mr.analysis.probe`, `experiments.probe`)."""

import inspect
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.analysis import probe
from fedjax_mr.core import errors
from fedjax_mr.data import datasets
from fedjax_mr.models import model as model_lib
from fedjax_mr.models import multi_exit
from fedjax_mr.pipeline import experiment
from fedjax_mr.pipeline import stitch_config
from fedjax_mr.stitch import network
from fedjax_mr.stitch import pool as pool_lib
from tests import fork_server
from tests import helpers

REFERENCE = 120  # public examples the tiny probe is fitted on


def _quiet(line):
  del line


@pytest.fixture(scope='module')
def tiny(small_fmnist_dir, tmp_path_factory):
  """A pool (an untrained cnn_mnist of classes 0-4, the first 600 training
  examples public) and a finished 3-round run fine-tuning it on classes
  5-9 that kept its last 2 checkpoints."""
  root = tmp_path_factory.mktemp('probe')
  pool = str(root / 'pool')
  model = model_lib.get('cnn_mnist', 5, (28, 28, 1))
  pool_lib.save_model(
    pool,
    'cnn_mnist',
    model,
    model.init(jax.random.key(3)),
    dataset='fashion_mnist',
    classes=[0, 1, 2, 3, 4],
  )
  public = {'dataset': 'fashion_mnist', 'seed': 0, 'indices': list(range(600))}
  with open(os.path.join(pool, 'public.json'), 'w') as f:
    json.dump(public, f)
  config = helpers.small_config(
    small_fmnist_dir,
    classes='5-9',
    model='cnn_mnist',
    init_from=os.path.join(pool, 'cnn_mnist'),
    num_clients=4,
    clients_per_round=2,
    batch_size=25,
    rounds=3,
    keep_checkpoints=2,
  )
  work = str(root / 'run')
  experiment.train_and_evaluate(config, work, log=_quiet)
  return {'pool': pool, 'run': work, 'data_dir': small_fmnist_dir}


def _knn_by_hand(ref, ref_y, feats, k):
  """Euclidean kNN, majority vote, ties to the nearest: a plain loop."""
  out = []
  for f in np.asarray(feats, np.float64):
    d = np.sum((np.asarray(ref, np.float64) - f) ** 2, axis=1)
    nearest = np.argsort(d, kind='stable')[:k]
    labels = ref_y[nearest]
    counts = {c: np.sum(labels == c) for c in labels}
    top = max(counts.values())
    out.append(next(c for c in labels if counts[c] == top))
  return np.array(out)


def test_the_probe_is_a_plain_knn_on_the_trunk_of_each_kept_round(tiny):
  lines = []
  rec = probe.probe(tiny['run'], knn_reference=REFERENCE, log=lines.append)
  assert rec['rounds'] == [2, 3] and len(lines) == 2
  assert rec['k'] == 5 and rec['reference_size'] == REFERENCE
  assert rec['pool'] == os.path.abspath(tiny['pool'])  # from --init_from
  assert rec['features'] == 4 * 4 * 50  # cnn_mnist's flattened conv output
  saved = json.load(open(os.path.join(tiny['run'], probe.PROBE_FILE)))
  assert saved['accuracy'] == rec['accuracy']
  assert saved['mean'] == pytest.approx(np.mean(rec['accuracy']), abs=0)
  # The head's recorded accuracies of those rounds, beside the probe's.
  rows = [
    json.loads(x) for x in open(os.path.join(tiny['run'], 'metrics.jsonl'))
  ]
  assert rec['head_accuracy'] == [r['test_accuracy'] for r in rows[1:]]
  # One classifier: no exits to read alone.
  assert rec['exit_accuracy'] is None and rec['exit_mean'] is None
  assert 'exits' not in lines[0]
  # The reference: the first 120 public examples of classes 5-9, relabelled.
  ds = datasets.load('fashion_mnist', tiny['data_dir'])
  ref = [i for i in range(600) if ds.y_train[i] >= 5][:REFERENCE]
  test = np.flatnonzero(ds.y_test >= 5)
  # Round 3 by hand: the model restored, its trunk's features, a plain kNN.
  run = experiment.load_run(tiny['run'], round_index=3)
  net = probe.trunk(run.model, run.state.server.params)
  scale, shift = ds.scale, ds.shift
  feats = network.outputs(net, ds.x_test[test], scale=scale, shift=shift)
  ref_feats = network.outputs(net, ds.x_train[ref], scale=scale, shift=shift)
  pred = _knn_by_hand(ref_feats, ds.y_train[ref] - 5, feats, 5)
  assert rec['accuracy'][1] == np.mean(pred == ds.y_test[test] - 5)
  # The trunk is the classifier's input: the end block on it gives the
  # model's logits.
  x = jnp.asarray(ds.x_test[test[:8]], jnp.float32) * scale + shift
  logits = run.model.apply_eval(jax.device_get(run.state.server.params), x)
  end = _end_block(run.model, run.state.server.params)
  helpers.assert_close(
    end.apply(network.apply(net, x)), logits, rtol=1e-5, atol=1e-5
  )


def _end_block(model, variables):
  from fedjax_mr.stitch import blocks

  name, variables = probe.zoo_view(model, jax.device_get(variables))
  return blocks.split('m', name, variables, model.input_shape, probe.CUTS)[-1]


def test_a_pool_models_trunk_is_the_one_the_stitch_probe_reads(tiny):
  (pm,) = pool_lib.load(tiny['pool'])
  (chain,) = pool_lib.chains([pm], 'every_unit')
  # What experiments.stitch evaluates for a pool model under knn_at=trunk.
  theirs = network.trunk(network.Network(chain, (None,) * len(chain)))
  ours = probe.trunk(pm.model, pm.variables)
  ds = datasets.load('fashion_mnist', tiny['data_dir'])
  x = ds.x_test[:64]
  np.testing.assert_array_equal(
    network.outputs(ours, x, scale=ds.scale, shift=ds.shift),
    network.outputs(theirs, x, scale=ds.scale, shift=ds.shift),
  )
  assert (
    probe.K == inspect.signature(network.accuracies).parameters['k'].default
  )
  assert probe.KNN_REFERENCE == stitch_config.Evaluation().knn_reference


def _random_like(shapes):
  """Variables of the given shapes: N(0, 0.5²) entries, BatchNorm variances
  in [0.5, 1.5] (initialising a ResNet eagerly takes half a minute)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  rng = np.random.default_rng(0)
  out = []
  for path, s in leaves:
    if jax.tree_util.keystr(path).endswith("['var']"):
      out.append(rng.uniform(0.5, 1.5, s.shape).astype(s.dtype))
    else:
      out.append((0.5 * rng.standard_normal(s.shape)).astype(s.dtype))
  return jax.tree.unflatten(treedef, out)


def test_resnet18_w16_and_its_multi_exit_version_read_the_last_stage_map():
  model = model_lib.get('resnet18_w16', 5, (28, 28, 1))
  variables = jax.eval_shape(model.init, jax.random.key(0))
  # Stage 4 of the quarter-width ResNet-18 on 28 x 28: 4 x 4 x 128.
  assert probe.trunk(model, variables).out_spec == (4, 4, 128)
  deep = multi_exit.from_zoo(model)
  deep_vars = jax.eval_shape(deep.init, jax.random.key(0))
  assert probe.trunk(deep, deep_vars).out_spec == (4, 4, 128)
  # A small multi-exit ResNet-18 (the mapping does not depend on the
  # widths): the deepest exit on the trunk gives that exit's logits.
  small = multi_exit.resnet18(5, (8, 8, 1), widths=(2, 4, 4, 4))
  small_vars = _random_like(jax.eval_shape(small.init, jax.random.key(0)))
  net = probe.trunk(small, small_vars)
  x = jax.random.normal(jax.random.key(1), (3, 8, 8, 1))
  exit4 = small_vars['params']['exit4']
  # Jitted whole: one compilation each (seconds, not a minute).
  feats = jax.jit(lambda x: network.apply(net, x))(x)
  logits = jnp.mean(feats, axis=(1, 2)) @ exit4['kernel'] + exit4['bias']
  every = jax.jit(
    lambda v, x: small.module.apply(v, x, train=False, all_exits=True)
  )(small_vars, x)
  helpers.assert_close(logits, every[:, -1], rtol=1e-5, atol=1e-5)


def _neutral_batch_norm(shapes, seed):
  """Normal weights, BatchNorm as the identity and zero biases: random
  biases and statistics make a tiny network's exits predict one class
  for every input."""
  rng = np.random.default_rng(seed)

  def fill(path, s):
    name = jax.tree_util.keystr(path)
    if "'var'" in name or "'scale'" in name:
      return np.ones(s.shape, s.dtype)
    if "'mean'" in name or "'bias'" in name:
      return np.zeros(s.shape, s.dtype)
    return rng.standard_normal(s.shape).astype(s.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)


def test_each_exit_of_a_multi_exit_model_is_read_alone():
  # A small multi-exit ResNet-18 on 8 x 8 images of a bright row and a
  # grey column: each exit's accuracy is the share of test examples whose
  # own logits (the model applied to one example at a time, a plain loop)
  # put the label first; batches of 4 over 10 examples end in a short one.
  model = multi_exit.resnet18(5, (8, 8, 1), widths=(2, 4, 4, 4))
  variables = _neutral_batch_norm(
    jax.eval_shape(model.init, jax.random.key(0)), seed=1
  )
  rng = np.random.default_rng(0)
  x = np.zeros((10, 8, 8, 1), np.uint8)
  for i in range(10):
    row, col = rng.integers(0, 8, 2)
    x[i, row, :, 0] = 255
    x[i, :, col, 0] = 128
  one = jax.jit(
    lambda v, x: model.module.apply(v, x, train=False, all_exits=True)
  )
  pred = np.stack(
    [
      np.asarray(one(variables, xi[None] / np.float32(255) - 0.5))[0]
      for xi in x
    ]
  ).argmax(-1)  # [10 examples, 4 exits]
  # An exit that tells these examples apart, so that a pairing of logits
  # and labels that slips shows; labelled as it predicts on 7 of them.
  e = int(np.argmax([len(set(p)) for p in pred.T]))
  assert len(set(pred[:, e])) > 1, pred
  y = np.where(np.arange(10) < 7, pred[:, e], (pred[:, e] + 1) % 5)
  data = probe.ProbeData(x[:0], y[:0], x, y, 1 / 255, -0.5)
  got = probe.exit_reader(model, batch_size=4)(variables, data)
  assert got[e] == 0.7
  helpers.assert_close(got, (pred == y[:, None]).mean(0), atol=1e-12)
  assert (
    probe.exits_text(got)
    == ', exits ' + '/'.join(f'{100 * a:.2f}' for a in got) + ' %'
  )
  # The zoo ResNet-18 has one classifier: nothing to read.
  assert (
    probe.exit_reader(model_lib.get('resnet18_w16', 5, (28, 28, 1))) is None
  )


def test_an_unfinished_or_damaged_run_is_refused_and_nothing_written(
  tiny, tmp_path
):
  work = str(tmp_path / 'run')
  shutil.copytree(
    tiny['run'], work, ignore=shutil.ignore_patterns('probe.json')
  )
  config_path = os.path.join(work, 'config.json')
  saved = json.load(open(config_path))
  json.dump({**saved, 'rounds': 5}, open(config_path, 'w'))
  with pytest.raises(
    errors.ConfigError, match='not a finished run.* round 3 of 5'
  ):
    probe.probe(work, knn_reference=REFERENCE, log=_quiet)
  json.dump(saved, open(config_path, 'w'))
  # A flipped bit in the last checkpoint's arrays: its digest refuses it.
  helpers.flip_checkpoint_byte(os.path.join(work, 'checkpoints', '3'))
  with pytest.raises(errors.ConfigError, match='round 3 does not restore'):
    probe.probe(work, knn_reference=REFERENCE, log=_quiet)
  assert not os.path.exists(os.path.join(work, probe.PROBE_FILE))


def test_the_program_prints_each_round_and_the_mean(tiny, tmp_path):
  work = str(tmp_path / 'run')
  shutil.copytree(
    tiny['run'], work, ignore=shutil.ignore_patterns('probe.json')
  )
  # A process of its own, forked from one that imported the libraries the
  # programs share (tests/fork_server.py).
  proc = fork_server.run_module(
    'experiments.probe',
    f'--workdir={work}',
    f'--knn_reference={REFERENCE}',
    f'--pool={tiny["pool"]}',
  )
  assert proc.returncode == 0, proc.stderr
  # The run's two host devices set up before JAX starts: no warning.
  assert 'Warning' not in proc.stderr, proc.stderr
  rec = json.load(open(os.path.join(work, probe.PROBE_FILE)))
  lines = proc.stdout.splitlines()
  assert lines[0].startswith('round 2: 5-NN on the trunk (800 features) ')
  assert f'{100 * rec["accuracy"][1]:.2f} %' in lines[1]
  assert lines[2].startswith('5-NN on the trunk, mean of rounds 2–3 (2 ')
  assert f'{100 * rec["mean"]:.2f} %' in lines[2]
