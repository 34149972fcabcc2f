"""Runs experiments.run with RSS sampled per phase."""

import functools
import sys
import threading
import time

phase = ['startup']
peaks = {}
order = []


def rss():
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('VmRSS'):
        return int(line.split()[1]) / 1024


def sampler():
  while True:
    p = phase[0]
    r = rss()
    if p not in peaks:
      order.append(p)
      peaks[p] = (r, r)
    peaks[p] = (peaks[p][0], max(peaks[p][1], r))
    time.sleep(0.01)


threading.Thread(target=sampler, daemon=True).start()


def wrap(mod, name, label=None):
  f = getattr(mod, name)

  @functools.wraps(f)
  def g(*a, **k):
    prev = phase[0]
    lab = label or name
    phase[0] = f'{lab} (in {prev})' if prev != 'main' else lab
    time.sleep(0.02)
    try:
      return f(*a, **k)
    finally:
      time.sleep(0.02)
      phase[0] = prev

  setattr(mod, name, g)


from fedjax_mr.harness import checkpoint  # noqa: E402 (after the sampler starts)
from fedjax_mr.harness import resume  # noqa: E402 (after the sampler starts)

from fedjax_mr.training import engine  # noqa: E402 (after the sampler starts)
from fedjax_mr.training import host_round  # noqa: E402 (after the sampler starts)

wrap(engine, 'init_state')
wrap(engine, 'to_host_clients')
wrap(checkpoint, 'digest')
wrap(checkpoint.Checkpointer, 'save')
wrap(resume, 'restore')
orig = host_round.make_host_round


def mhr(*a, **k):
  step = orig(*a, **k)
  n = [0]

  def s(*x, **y):
    n[0] += 1
    prev = phase[0]
    phase[0] = f'round {n[0]}'
    try:
      return step(*x, **y)
    finally:
      phase[0] = prev

  return s


host_round.make_host_round = mhr
import orbax.checkpoint as ocp  # noqa: E402 (after the sampler starts)

wrap(ocp.CheckpointManager, 'save', 'orbax save')
phase[0] = 'main'
from absl import app  # noqa: E402 (after the sampler starts)

from experiments import run  # noqa: E402 (after the sampler starts)

try:
  app.run(run.main, argv=['run'] + sys.argv[1:])
finally:
  for p in order:
    print(
      f'{p:50s} start {peaks[p][0]:8.0f} MiB  peak {peaks[p][1]:8.0f} MiB',
      file=sys.stderr,
    )
