"""Issue 75's costs of distributed DP, measured in one process:

1. A client's host step (`skellam.randomize`: the conditional rounding
   and the Skellam noise from SHAKE-256) for an update of cnn_mnist's and
   resnet20's sizes at the integers of run.sh's setting (C 0.5, z 1.127,
   K 100, m 67, 32 bits); medians of 5.
2. ε after 200 rounds of run.sh's setting (N 10,000, K 100, δ 1/N^1.1):
   the Skellam accountant at the run's B and d against the Gaussian's
   (central DP) at the same z, and at a scale 256 times smaller (S = 256:
   what fewer bits would force).
3. A round of run.sh's setting (FedAvg, z 1.127) compiled as
   experiments.run compiles it: central DP on this machine's two host
   devices and on one, distributed DP (one CPU device: its host step);
   timed alternately after a compiling round, medians of 5.

  cd docs/results/privacy/distributed
  ../../../../.venv/bin/python cost.py > cost.txt
"""

import os
import statistics
import subprocess
import sys
import time

sys.path.insert(
  0, os.path.join(os.path.dirname(__file__), '..', '..', '..', '..')
)
# Two host devices, as experiments.run makes on a 2-core machine (part 3).
os.environ['XLA_FLAGS'] = (
  os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=2'
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from fedjax_mr import privacy  # noqa: E402
from fedjax_mr.models import model as model_lib  # noqa: E402
from fedjax_mr.pipeline import config as config_lib  # noqa: E402
from fedjax_mr.pipeline import experiment  # noqa: E402
from fedjax_mr.privacy import distributed_dp  # noqa: E402
from fedjax_mr.privacy import skellam  # noqa: E402

N, K, CLIP = 10_000, 100, 0.5
M = distributed_dp.min_clients(K, 2 / 3)


def _size(name):
  model = model_lib.get(
    name, 10, (28, 28, 1) if name == 'cnn_mnist' else (32, 32, 3)
  )
  variables = model.init(jax.random.key(0))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(variables))


def host_step():
  print("1. a client's host step (rounding and noise), medians of 5")
  for name in ('cnn_mnist', 'resnet20'):
    d = _size(name)
    cal = distributed_dp.calibrate(d, CLIP, 1.127, K, M, 32, 10.0)
    x = np.random.default_rng(0).normal(size=d)
    x *= cal.units / np.linalg.norm(x)  # an update at the clip norm
    times = []
    for i in range(6):
      t0 = time.perf_counter()
      skellam.randomize(x, cal.bound, cal.client_variance, bytes([i]))
      times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times[1:])
    print(
      f'{name:10s} {d:9,d} values: {ms:6.1f} ms '
      f'(S {cal.units:g}, B {cal.bound:,.1f}, client variance '
      f'{cal.client_variance:.4g})'
    )


def epsilons():
  print()
  print('2. epsilon after 200 rounds, N 10,000, K 100, delta 1/N^1.1')
  delta = privacy.default_delta(N)
  d = _size('cnn_mnist')
  for z in (1.127, 1.8):
    cal = distributed_dp.calibrate(d, CLIP, z, K, M, 32, 10.0)
    small = skellam.norm_bound(256.0, d)
    gauss = privacy.Accountant(z, N, K, delta).epsilon(200)
    dist = privacy.SkellamAccountant(z, N, K, delta, cal.bound, d)
    tight = privacy.SkellamAccountant(z, N, K, delta, small, d)
    print(
      f'z {z}: central {gauss:.6f}; distributed (S {cal.units:g}) '
      f'{dist.epsilon(200):.6f}; distributed (S 256) '
      f'{tight.epsilon(200):.6f}'
    )


ROUND = dict(
  algorithm='fedavg',
  num_clients=N,
  clients_per_round=K,
  partition='iid',
  local_epochs=5,
  batch_size=10,
  lr=0.05,
  seed=0,
  weighting='uniform',
  dp_clip=CLIP,
  dp_noise_multiplier=1.127,
)
KINDS = {
  'central, 2 devices': {},
  'central, 1 device': {'num_devices': 1},
  'distributed, 1 device': {'secure_aggregation': True},
}


def round_times():
  print()
  print('3. a round of run.sh (FedAvg, z 1.127), medians of 5')
  steps = {}
  for name, flags in KINDS.items():
    config = config_lib.ExperimentConfig.from_flat(**ROUND, **flags)
    exp = experiment.setup(config)
    step = experiment._compile_round(exp, 1)
    state, _ = step(exp.state, exp.data, exp.key)  # compiles
    jax.block_until_ready(state)
    steps[name] = [step, state, exp]
  times = {name: [] for name in KINDS}
  for _ in range(5):
    for name in KINDS:
      step, state, exp = steps[name]
      t0 = time.perf_counter()
      state, metrics = step(state, exp.data, exp.key)
      jax.block_until_ready((state, metrics))
      times[name].append(time.perf_counter() - t0)
      steps[name][1] = state
  base = statistics.median(times['central, 2 devices'])
  for name in KINDS:
    t = statistics.median(times[name])
    print(f'{name:22s} {t:.2f} s a round ({t / base:.2f}x)')


if __name__ == '__main__':
  commit = subprocess.run(
    ['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True
  ).stdout.strip()
  with open('/proc/cpuinfo') as f:
    cpu = next(
      (line.split(':', 1)[1].strip() for line in f if 'model name' in line),
      '?',
    )
  print(f'machine: {cpu}, {os.cpu_count()} CPUs; commit {commit}')
  host_step()
  epsilons()
  round_times()
