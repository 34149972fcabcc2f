"""`bench.measure` on tiny settings: what it counts and the ratios it
reports are those of the rounds it timed."""

import math
import statistics

import numpy as np
import pytest

from fedjax_mr import bench
from fedjax_mr.core import errors
from fedjax_mr.data import synthetic


def _local_steps(sizes, ids, b, epochs):
  """The local steps of clients `ids`: E × ceil(n / B) each."""
  return sum(epochs * -(-int(sizes[i]) // b) for i in ids)


# Each measures a few rounds (compiling them): seconds, so slow.
@pytest.fixture(scope='module')
def synthetic_report():
  # 4 of 50 generated clients, a logistic regression: compiles in seconds.
  setting = bench.Setting(
    dataset='synthetic',
    model='logistic',
    num_clients=50,
    clients_per_round=4,
    local_epochs=2,
    batch_size=10,
    rounds=3,
    eval_every=4,
    peak=False,
    dataset_options={'synthetic_alpha': 0.5, 'synthetic_beta': 1.0},
  )
  lines = []
  return bench.measure(setting, log=lines.append), lines


@pytest.mark.slow
def test_it_counts_the_clients_local_steps(synthetic_report):
  report, _ = synthetic_report
  (r,) = report.results
  s = report.setting
  sizes = np.asarray(synthetic.from_seed(50, 0.5, 1.0, 0).sizes)
  b = min(s.batch_size, int(sizes.max()))
  assert len(r.client_ids) == len(r.round_steps) == s.rounds
  for ids, steps in zip(r.client_ids, r.round_steps):
    assert len(set(ids)) == s.clients_per_round
    assert steps == _local_steps(sizes, ids, b, s.local_epochs)
  assert r.steps == statistics.median(r.round_steps)


@pytest.mark.slow
def test_its_ratios_are_those_of_the_timed_rounds(synthetic_report):
  report, _ = synthetic_report
  (r,) = report.results
  assert len(r.times) == len(r.limits) == 3
  assert all(t > 0 for t in r.times + r.limits)
  assert r.round_s == statistics.median(r.times)
  assert r.limit_s == statistics.median(r.limits)
  assert r.ratio == pytest.approx(
    statistics.median(t / lim for t, lim in zip(r.times, r.limits))
  )
  assert r.overhead_s == pytest.approx(
    statistics.median(t - lim for t, lim in zip(r.times, r.limits))
  )
  assert r.eval_pct == pytest.approx(100 * r.eval_s / (4 * r.round_s))
  assert r.evaluated == 1 and r.test_examples > 0
  assert r.pytorch_s is None and r.fedavg_ratio is None
  assert len(r.state_sha256) == 64


@pytest.mark.slow
def test_its_lines_say_the_figures(synthetic_report):
  report, logged = synthetic_report
  (r,) = report.results
  assert list(report.lines) == logged
  assert report.lines[0].startswith(
    'fedavg, logistic on synthetic: K=4 of N=50, E=2, B=10; '
  )
  assert report.lines[1].startswith('Synthetic(0.5, 1): 50 clients generated')
  assert (
    'PyTorch reference: none for generated clients (`dataset=synthetic`)'
    in report.lines
  )
  assert any(
    line.startswith('[lognormal, 1 device(s), ')
    and f'round/limit {r.ratio:.3f} ' in line
    for line in report.lines
  )
  assert report.peak_gflops is None
  assert not any(line.startswith('matmul peak') for line in report.lines)
  assert (
    report.lines[-2]
    == f'evaluation share: {r.eval_pct:.1f}% (once per 4 rounds)'
  )
  assert report.lines[-1] == f'round/limit ratio: {r.ratio:.2f}'


class _FakeTorchLoop:
  """Takes the steps the clients take, in a fixed time."""

  def __init__(self, partition, setting):
    self.sizes = [len(p) for p in partition]
    self.setting = setting

  def round(self, client_ids):
    s = self.setting
    return 0.5, _local_steps(
      self.sizes, client_ids, s.batch_size, s.local_epochs
    )


@pytest.mark.slow
def test_a_torch_loop_is_timed_beside_each_round():
  setting = bench.Setting(
    random_data=True,
    random_train_size=200,
    num_clients=4,
    clients_per_round=2,
    local_epochs=1,
    rounds=2,
    limit=False,
    peak=False,
  )
  made = []

  def torch_loop(s, ds, partition, num_params, device):
    made.append((num_params, device))
    return _FakeTorchLoop(partition, s), 'PyTorch TF32: as it was'

  report = bench.measure(setting, torch_loop=torch_loop)
  (r,) = report.results
  assert made == [(66_130, 'cpu')]  # cnn_mnist's parameters
  assert report.lines[1] == 'PyTorch TF32: as it was'
  assert r.pytorch_s == 0.5
  assert r.pytorch_ratio == pytest.approx(
    statistics.median(t / 0.5 for t in r.times)
  )
  assert all(math.isnan(lim) for lim in r.limits)
  assert 'per-client overhead: not measured (`nolimit`)' in report.lines
  assert report.lines[-1] == f'round/pytorch ratio: {r.pytorch_ratio:.2f}'


@pytest.mark.slow
def test_without_torch_it_says_so():
  setting = bench.Setting(
    random_data=True,
    random_train_size=200,
    num_clients=4,
    clients_per_round=2,
    local_epochs=1,
    rounds=1,
    peak=False,
  )
  report = bench.measure(setting)
  assert report.lines[1] == bench.NO_TORCH_LINE
  assert report.results[0].pytorch_ratio is None


@pytest.mark.parametrize(
  'change, says',
  [
    ({'rounds': 0}, '`rounds` must be ≥ 1, got 0'),
    ({'num_clients': 5}, '`clients_per_round=10` exceeds `num_clients=5`'),
    ({'alpha': math.inf}, '`alpha` must be finite'),
    ({'client_chunks': (1, -1)}, '`client_chunks` takes counts ≥ 0'),
    ({'algorithm': 'nope'}, '`algorithm`'),
  ],
)
def test_a_bad_setting_is_refused_naming_its_field(change, says):
  with pytest.raises(errors.UserError, match=says):
    bench.check(bench.Setting(**change))


def test_the_settings_shared_flags_are_the_training_programs():
  # Defined once in the training config: the same help, choices and
  # default; num_devices's other default gives its reason.
  import dataclasses

  from fedjax_mr.pipeline import config as config_lib

  train = {f.name: f for f in config_lib.base_fields()}
  shared = [
    f for f in dataclasses.fields(bench.Setting) if 'run_only' in f.metadata
  ]
  assert sorted(f.name for f in shared) == sorted(
    'dataset data_dir model num_clients clients_per_round local_epochs '
    'batch_size num_devices client_chunk host_devices algorithm '
    'eval_batch_size'.split()
  )
  for f in shared:
    if f.name == 'num_devices':
      assert (
        f.default == 1
        and 'Here default 1: the plain PyTorch' in (f.metadata['help'])
      )
      continue
    assert f.metadata == train[f.name].metadata, f.name
    assert f.default == train[f.name].default, f.name
  assert bench.choices(
    {f.name: f for f in shared}['algorithm']
  ) == config_lib.choices(train['algorithm'])
