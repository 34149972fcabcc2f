"""The cost of DP per round (issue 74): the setting of run.sh, each
algorithm's plain round against its DP round (clip and noise, and the
adaptive clip), compiled as experiments.run compiles them, timed
alternately after a warm-up (the median of 10 rounds each), on this
machine's default placement.

  .venv/bin/python docs/results/privacy/cost.py > docs/results/privacy/cost.txt
"""

import platform
import statistics
import subprocess
import time

import jax

from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import experiment

COMMON = dict(
  num_clients=10_000,
  clients_per_round=100,
  partition='iid',
  local_epochs=5,
  batch_size=10,
  lr=0.05,
  seed=0,
  weighting='uniform',
)
DP = {
  'plain': {},
  'dp': {'dp_clip': 0.5, 'dp_noise_multiplier': 1.127},
  'adaptive': {
    'dp_clip': 0.5,
    'dp_noise_multiplier': 1.127,
    'dp_adaptive_quantile': 0.5,
  },
}
ROUNDS = 10


def _cpu():
  for line in open('/proc/cpuinfo'):
    if line.startswith('model name'):
      return line.split(':', 1)[1].strip()
  return platform.processor()


def main():
  commit = subprocess.run(
    ['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True
  ).stdout.strip()
  print(f'machine: {_cpu()}; commit {commit}; {ROUNDS} rounds each, medians')
  for algorithm in ('fedavg', 'fedmut', 'scaffold'):
    steps = {}
    for name, flags in DP.items():
      config = config_lib.ExperimentConfig.from_flat(
        algorithm=algorithm, **COMMON, **flags
      )
      exp = experiment.setup(config)
      step = experiment._compile_round(exp, 1)
      state, _ = step(exp.state, exp.data, exp.key)  # compiles
      jax.block_until_ready(state)
      steps[name] = [step, state, exp]
    times = {name: [] for name in DP}
    for _ in range(ROUNDS):
      for name in DP:
        step, state, exp = steps[name]
        t0 = time.perf_counter()
        state, metrics = step(state, exp.data, exp.key)
        jax.block_until_ready((state, metrics))
        times[name].append(time.perf_counter() - t0)
        steps[name][1] = state
    plain = statistics.median(times['plain'])
    line = f'{algorithm}: plain {plain:.3f} s'
    for name in ('dp', 'adaptive'):
      t = statistics.median(times[name])
      line += f'; {name} {t:.3f} s ({t / plain:.2f}x)'
    print(line, flush=True)


if __name__ == '__main__':
  main()
