"""Compares two finished workdirs of one setting: their metrics and
clients rows (the times left out) and their final states, bit for bit.

Usage: XLA_FLAGS=--xla_force_host_platform_device_count=2 python
docs/results/scale/synth_scaffold_host_compare.py WORKDIR_A WORKDIR_B
"""

import json
import sys

import jax
import numpy as np
from fedjax_mr.harness import checkpoint
from fedjax_mr.harness import experiment

TIMES = ('time', 'elapsed', 'second', 'wall')


def rows(workdir, name):
  with open(f'{workdir}/{name}') as f:
    return [
      {
        k: v
        for k, v in json.loads(line).items()
        if not any(t in k for t in TIMES)
      }
      for line in f
    ]


def same_bits(x, y):
  x, y = np.asarray(x), np.asarray(y)
  return (
    x.dtype == y.dtype
    and x.shape == y.shape
    and np.array_equal(
      x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)
    )
  )


def main(a, b):
  for name in ('metrics.jsonl', 'clients.jsonl'):
    ra, rb = rows(a, name), rows(b, name)
    print(name, len(ra), 'rows, identical:', ra == rb)
  with open(f'{a}/metrics.jsonl') as f:
    first = json.loads(f.readline())
  dropped = sorted(set(first) - set(rows(a, 'metrics.jsonl')[0]))
  print('metrics keys dropped:', dropped)
  run_a, run_b = experiment.load_run(a), experiment.load_run(b)
  sa, sb = jax.device_get(run_a.state), jax.device_get(run_b.state)
  la, ta = jax.tree.flatten(sa)
  lb, tb = jax.tree.flatten(sb)
  print(
    'rounds', run_a.round, run_b.round, 'same tree', ta == tb, 'leaves', len(la)
  )
  same = all(same_bits(x, y) for x, y in zip(la, lb))
  digests = checkpoint.digest(sa, {}) == checkpoint.digest(sb, {})
  print('final state bit-identical:', same, 'digest', digests)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(sa.clients))
  print('client-state bytes', nbytes)


if __name__ == '__main__':
  main(*sys.argv[1:])
