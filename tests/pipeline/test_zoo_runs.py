"""Every (dataset, model) pair of the papers runs 2 rounds end to end, on
tiny mock data (tfds) or tiny fixtures in the real formats (LEAF, CINIC-10);
kill-and-resume keeps the BatchNorm state exact."""

import json
import math
import os
import re

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from fedjax_mr.analysis import compare
from fedjax_mr.core import errors
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import experiment
from fedjax_mr.pipeline import registry
from tests import helpers
from tests.data import test_leaf_cinic as fixtures

# 2 clients of 4 examples, batch 3: every epoch ends with a partial batch.
TINY = config_lib.ExperimentConfig.from_flat(
  num_clients=2,
  clients_per_round=2,
  partition='iid',
  local_epochs=1,
  batch_size=3,
  rounds=2,
  eval_every=1,
  eval_batch_size=8,
  checkpoint_every=0,
)
# VGG-16 and the ResNets (slow on CPU) get 2 examples per client: still
# one partial batch an epoch.
HEAVY = ('vgg16', 'resnet18', 'resnet20')


@pytest.fixture(scope='module')
def data_dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp('zoo_data')
  femnist, _, _ = fixtures.write_femnist(
    root / 'femnist', [6, 3, 5, 2], [1, 1, 1, 1]
  )
  shakespeare, _, _ = fixtures.write_shakespeare(
    root / 'shakespeare', [5, 4, 3], [2, 1, 1]
  )
  cinic10, _ = fixtures.write_cinic(root / 'cinic10', per_class=1)
  return {'femnist': femnist, 'shakespeare': shakespeare, 'cinic10': cinic10}


def _quiet(line):
  del line


def _run(config, workdir, data_dirs, **kw):
  if config.data.dataset in data_dirs:
    config = config.replace(data_dir=data_dirs[config.data.dataset])
    return experiment.train_and_evaluate(config, workdir, log=_quiet, **kw)
  examples = 4 if config.model.name in HEAVY else 8
  with tfds.testing.mock_data(num_examples=examples):
    return experiment.train_and_evaluate(config, workdir, log=_quiet, **kw)


# The papers' pairs: FedMR Table 1 (CNN, ResNet-20, VGG-16 on CIFAR-10/100;
# CNN on FEMNIST), FedMut Tables 1-2 (ResNet-18; Shakespeare LSTM),
# FedStitch's CINIC-10, and (Fashion-)MNIST for the small CNN. ResNet-20
# runs on CIFAR-100 in the kill-and-resume test below. (ResNet-20 on
# 28×28×1 FEMNIST: its shapes are checked in tests/models/test_zoo.py.) The
# other slow models run on one of the two CIFARs each: the loaders are the
# CNN's; so does CINIC-10 (its loader with the CNN).
PAIRS = [
  ('cifar10', 'cnn_cifar', {}),
  ('cifar10', 'vgg16', {}),
  ('cifar100', 'cnn_cifar', {'cifar100_labels': 'coarse'}),
  ('cifar100', 'resnet18', {}),
  (
    'femnist',
    'cnn_femnist',
    {'partition': 'natural', 'leaf_min_samples': 3},
  ),
  ('shakespeare', 'char_lstm', {'partition': 'natural'}),
  ('cinic10', 'cnn_cifar', {}),
  ('fashion_mnist', 'cnn_mnist', {'data_dir': 'EMPTY'}),
  ('mnist', 'cnn_mnist', {'data_dir': 'EMPTY'}),
]


@pytest.mark.parametrize(
  'dataset,model,changes', PAIRS, ids=[f'{d}-{m}' for d, m, _ in PAIRS]
)
def test_pair_runs_two_rounds(data_dirs, tmp_path, dataset, model, changes):
  if changes.get('data_dir') == 'EMPTY':  # no IDX files: tfds (mocked)
    (tmp_path / 'empty').mkdir()
    changes = {**changes, 'data_dir': str(tmp_path / 'empty')}
  cfg = TINY.replace(dataset=dataset, model=model, **changes)
  res = _run(cfg, str(tmp_path / 'work'), data_dirs)
  assert [r['round'] for r in res.history] == [1, 2]
  assert all(math.isfinite(r['train_loss']) for r in res.history)
  # Each round trains the sampled clients' examples in ceil(n / B) steps
  # an epoch (the partition's sizes, counted here).
  with open(os.path.join(res.workdir, 'partition.json')) as f:
    sizes = json.load(f)['sizes']
  for r in res.history:
    n = [sizes[i] for i in r['client_ids']]
    assert r['num_examples'] == sum(n) > 0
    assert r['num_steps'] == cfg.local.local_epochs * sum(
      -(-s // cfg.local.batch_size) for s in n
    )
  variables = jax.device_get(res.state.server.params)
  if model in ('resnet20', 'resnet18', 'vgg16'):
    # The averaged BatchNorm statistics moved away from (0, 1).
    means = jax.tree.leaves(
      {k: v['mean'] for k, v in _bn_stats(variables['batch_stats'])}
    )
    assert max(float(np.abs(m).max()) for m in means) > 0
  else:
    assert set(variables) == {'params'}


def _bn_stats(stats, prefix=''):
  """(path, {'mean', 'var'}) for every BatchNorm in a batch_stats tree."""
  if 'mean' in stats and 'var' in stats:
    return [(prefix, stats)]
  out = []
  for k, v in stats.items():
    out += _bn_stats(v, f'{prefix}/{k}')
  return out


def test_natural_partition_uses_the_leaf_users(data_dirs, tmp_path):
  cfg = TINY.replace(
    dataset='femnist',
    model='cnn_femnist',
    partition='natural',
    num_clients=2,
    rounds=1,
  )
  with pytest.raises(
    errors.ConfigError, match='`num_clients=5` exceeds the 4 users'
  ):
    _run(cfg.replace(num_clients=5), str(tmp_path / 'a'), data_dirs)
  _run(cfg, str(tmp_path / 'b'), data_dirs)
  part = json.load(open(tmp_path / 'b' / 'partition.json'))
  # Two of the writers (sizes 6, 3, 5, 2), whole.
  assert len(part['sizes']) == 2 and set(part['sizes']) <= {6, 3, 5, 2}


def test_resnet20_kill_and_resume_keeps_batch_norm_state(data_dirs, tmp_path):
  cfg = TINY.replace(dataset='cifar100', model='resnet20', checkpoint_every=1)
  ref = _run(cfg, str(tmp_path / 'ref'), data_dirs)
  assert [r['round'] for r in ref.history] == [1, 2]
  assert 0.0 <= ref.history[-1]['test_accuracy'] <= 1.0

  def crash(r, row):  # after round 1's checkpoint
    del row
    if r == 1:
      raise RuntimeError('crash')

  work = str(tmp_path / 'killed')
  with pytest.raises(RuntimeError, match='^crash$'):
    _run(cfg, work, data_dirs, on_round=crash)
  res = _run(cfg, work, data_dirs)
  state, ref_state = jax.device_get(res.state), jax.device_get(ref.state)
  stats = _bn_stats(state.server.params['batch_stats'])
  assert len(stats) == 18  # 6 blocks × 3 BatchNorms, no final one
  assert max(float(np.abs(s['mean']).max()) for _, s in stats) > 0
  helpers.tree_equal(state, ref_state)
  strip = lambda rows: [  # noqa: E731
    {k: v for k, v in r.items() if not k.endswith('_s')} for r in rows
  ]
  assert strip(res.history) == strip(ref.history)


CONFIGS = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
  'experiments',
  'configs',
)


def _read_flagfile(path):
  """An absl flagfile of `--name=value` lines as an ExperimentConfig."""
  fields = {f.name: f for f in config_lib.base_fields()}
  fields.update({n: f for n, (f, _) in registry.all_flags().items()})
  values = {}
  for line in open(path):
    line = line.strip()
    if not line or line.startswith('#'):
      continue
    name, value = line[2:].split('=', 1)
    kind = type(fields[name].default)
    if kind is bool:
      values[name] = value.lower() == 'true'
    else:
      values[name] = kind(value)
  return config_lib.ExperimentConfig.from_flat(**values)


def test_paper_flagfiles_are_valid_and_named_by_their_setting():
  files = sorted(
    f
    for f in os.listdir(CONFIGS)
    if f.endswith('.flags') and f.split('_')[0] in config_lib._dataset_names()
  )
  assert len(files) == 36
  for name in files:
    cfg = _read_flagfile(os.path.join(CONFIGS, name))
    checks.validate(cfg)
    dataset, model, part = name[: -len('.flags')].split('_')
    assert cfg.data.dataset == dataset and cfg.run.workdir.endswith(name[:-6])
    assert model in cfg.model.name or (model, cfg.model.name) == (
      'lstm',
      'char_lstm',
    )
    if part.startswith('dir'):
      assert (cfg.partition.kind, cfg.partition.alpha) == (
        'dirichlet',
        float(part[3:]),
      )
    else:
      assert cfg.partition.kind == part
    # The comment's compare command names the papers' variants, and they
    # validate against the file's setting.
    text = open(os.path.join(CONFIGS, name)).read()
    command = re.search(r'experiments.compare (.*?) --workdir=', text, re.S)
    args = command.group(1).replace('#', ' ').replace('\\', ' ').split()
    assert args[0] == f'--flagfile=experiments/configs/{name}'
    variants = []
    for arg in args[1:]:
      flag, value = arg.split('=', 1)
      parsed = value.split(',') if flag == '--variants' else [value]
      variants += [compare.parse_variant(v) for v in parsed]
    assert variants[0][0] == 'fedavg' and len(variants) >= 2
    compare.configs(cfg.flat(), variants, [0], '/nonexistent')
  docs = os.path.join(os.path.dirname(CONFIGS), '..', 'docs', 'configs.md')
  listed = open(docs).read()
  assert all(f'`{name}`' in listed for name in files)
