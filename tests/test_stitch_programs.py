"""pretrain_zoo and stitch run end to end on real data; bad flags are clear."""

import json
import os
import re

import pytest

from fedjax_mr.stitch import federated
from tests import helpers

_run = helpers.run_module


@pytest.fixture(scope='module')
def small_pool(small_fmnist_dir, tmp_path_factory):
  out = tmp_path_factory.mktemp('pool')
  proc = _run(
    'experiments.pretrain_zoo',
    f'--data_dir={small_fmnist_dir}',
    '--models=cnn_mnist,cnn_femnist',
    '--public_size=500',
    '--epochs=3',
    f'--workdir={out}',
  )
  assert proc.returncode == 0, proc.stderr
  return out, proc.stdout


def test_pretrain_zoo_saves_a_pool(small_pool):
  out, stdout = small_pool
  assert re.search(r'^cnn_mnist: test accuracy [\d.]+ %', stdout, re.M)
  split = json.load(open(os.path.join(out, 'public.json')))
  assert len(split['indices']) == 500
  meta = json.load(open(os.path.join(out, 'cnn_femnist', 'meta.json')))
  assert meta['model'] == 'cnn_femnist' and meta['input_shape'] == [28, 28, 1]
  # Trained on 500 real examples, it beats chance (10 %) by far.
  assert meta['test_accuracy'] > 0.4


def test_stitch_runs_evaluates_and_resumes(
  small_pool, small_fmnist_dir, tmp_path
):
  pool_dir, _ = small_pool
  args = (
    'experiments.stitch',
    f'--pool={pool_dir}',
    f'--data_dir={small_fmnist_dir}',
    '--num_clients=6',
    '--clients_per_round=3',
    '--rounds_per_selection=2',
    '--batch_size=32',
    '--eval=both',
    '--knn_reference=300',
    '--local_clients=1',
    f'--workdir={tmp_path}',
  )
  proc = _run(*args)
  assert proc.returncode == 0, proc.stderr
  out = proc.stdout
  assert re.search(r'^round +0 +depth 1 +pool \d+,\d+ ', out, re.M)
  assert re.search(r'energy, tx2_literal.*coordinator saves', out)
  results = json.load(open(tmp_path / 'results.json'))
  nets = results['networks']
  assert nets, 'no stitched network'
  for n in nets:
    assert 0 <= n['head'] <= 1 and 0 <= n['knn'] <= 1
  # Pool models trained on 500 real examples; stitched networks of their
  # blocks still classify far above chance.
  assert results['best']['head'] > 0.4
  assert set(results['pool_models']) == {'cnn_mnist', 'cnn_femnist'}
  assert len(results['local']['best']) == 1
  assert results['peak_host_mib'] > 0
  rounds = [json.loads(line) for line in open(tmp_path / 'log.jsonl')]
  assert [r['round'] for r in rounds] == list(range(len(rounds)))
  # A re-run resumes from state.npz: same networks, no new rounds.
  again = _run(*args)
  assert again.returncode == 0, again.stderr
  assert 'round ' not in again.stdout.split('stitched networks')[0]
  assert json.load(open(tmp_path / 'results.json'))['networks'] == nets
  # The networks are stored without a pickle, with the run's flags.
  finished, identity = federated.read_document(str(tmp_path / 'networks.npz'))
  assert sorted(f['round'] for f in finished) == sorted(
    n['round'] for n in nets
  )
  assert identity['seed'] == 0 and identity['num_clients'] == 6
  # Another setting on the same workdir is refused in one line, and the
  # state is untouched.
  state = (tmp_path / 'state.npz').read_bytes()
  other = _run(*args, '--partition=iid')
  assert other.returncode == 2
  assert other.stderr.count('\n') == 1 and "--partition='dirichlet'" in (
    other.stderr
  )
  assert (tmp_path / 'state.npz').read_bytes() == state
  # A pickle left by an older version is never loaded.
  old = tmp_path / 'old'
  old.mkdir()
  (old / 'state.pkl').write_bytes(b'\x80\x04\x95 whatever')
  refused = _run(*args[:-1], f'--workdir={old}')
  assert refused.returncode == 2 and 'never unpickles' in refused.stderr


def test_stitch_without_a_pool_says_how_to_make_one(small_fmnist_dir, tmp_path):
  proc = _run(
    'experiments.stitch',
    f'--pool={tmp_path}',
    f'--data_dir={small_fmnist_dir}',
    f'--workdir={tmp_path / "w"}',
  )
  assert proc.returncode != 0
  assert 'pretrain_zoo' in proc.stderr and 'Traceback' not in proc.stderr


def test_the_programs_choices_are_the_librarys():
  # Read from the source: importing the program would define its flags in
  # this process.
  import ast

  from fedjax_mr.stitch import blocks
  from fedjax_mr.stitch import cka
  from fedjax_mr.stitch import network
  from fedjax_mr.stitch import projection

  path = os.path.join(os.path.dirname(helpers.__file__), '..', 'experiments')
  tree = ast.parse(open(os.path.join(path, 'stitch.py')).read())
  (node,) = [
    n
    for n in tree.body
    if isinstance(n, ast.Assign)
    and getattr(n.targets[0], 'id', '') == 'CHOICES'
  ]
  choices = ast.literal_eval(node.value)
  assert {k: tuple(v) for k, v in choices.items()} == {
    'cuts': blocks.CUT_STYLES,
    'view': cka.VIEWS,
    'spatial': projection.SPATIAL_POLICIES,
    'stitch_solver': projection.SOLVERS,
    'aggregation': federated.AGGREGATIONS,
    'eval': network.EVAL_MODES,
  }
