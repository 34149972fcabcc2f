"""Round times with and without prefetching, and resident memory with the
training set in host memory or memory-mapped (BUILD.md "Scale: the
training set on the host").

  PYTHONPATH=. python docs/results/scale/prefetch/measure.py \
    PLACEMENT PREFETCH WORKDIR

runs the papers' default setting (experiments/configs/default.flags) for 3
rounds with `data_placement=PLACEMENT` and `prefetch=PREFETCH` (0 or 1),
as `python -m experiments.run --flagfile=... --rounds=3` does, and prints
one JSON line per round: its `round_time_s` (evaluation is timed apart),
and the process's resident memory (anonymous, file-backed, peak) after it.
With `PLACEMENT=host` it then prints the median seconds of one round's
gather (`client_data.gather_round`, what prefetching takes off the
critical path), over the ids of 20 rounds.
"""

import dataclasses
import json
import os
import sys
import time

from fedjax_mr.harness import config as config_lib
from fedjax_mr.harness import experiment

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), *['..'] * 4))


def default_config(**changes):
  fields = {f.name: f for f in dataclasses.fields(config_lib.ExperimentConfig)}
  values = {}
  with open(os.path.join(REPO, 'experiments/configs/default.flags')) as f:
    for line in f:
      if line.startswith('--'):
        name, value = line[2:].strip().split('=', 1)
        values[name] = type(fields[name].default)(value)
  values.update(changes)
  return config_lib.ExperimentConfig(**values)


def memory_mib():
  out = {}
  with open('/proc/self/status') as f:
    for line in f:
      name, _, value = line.partition(':')
      if name in ('RssAnon', 'RssFile', 'VmHWM'):
        out[name] = int(value.split()[0]) // 1024
  return out


def main(placement, prefetch, workdir):
  config = default_config(
    rounds=3,
    data_placement=placement,
    prefetch=bool(int(prefetch)),
    tensorboard=False,
    workdir=workdir,
  )

  def on_round(r, row):
    line = {'round': r, 'round_time_s': round(row['round_time_s'], 3)}
    print(json.dumps({**line, **memory_mib()}), flush=True)

  print(f'# fedjax_mr from {os.path.dirname(experiment.__file__)}')
  experiment.train_and_evaluate(config, log=print, on_round=on_round)
  if placement == 'host':
    gather_seconds(config)


def gather_seconds(config):
  import jax
  import numpy as np

  from fedjax_mr.data import client_data
  from fedjax_mr.training import engine
  from fedjax_mr.training import host_round

  ex = experiment.setup(config)
  sample = jax.jit(
    engine.make_sample_fn(ex.algorithm, config.clients_per_round)
  )
  times = []
  state = ex.state.replace(clients=())
  for r in range(20):
    ids = np.asarray(
      sample(state.replace(round=r), host_round.round_data(ex.data), ex.key)
    )
    t0 = time.perf_counter()
    client_data.gather_round(ex.data.data, ids, ex.data.capacity)
    times.append(time.perf_counter() - t0)
  print(json.dumps({'gather_median_s': float(np.median(times))}))


if __name__ == '__main__':
  main(*sys.argv[1:])
