"""Compares two workdirs: metrics and clients rows (timing keys aside) and
the final checkpoint's state, bit for bit."""
import json, sys
import jax, numpy as np
from fedjax_mr.harness import checkpoint
a, b = sys.argv[1], sys.argv[2]
TIMING = {'elapsed', 'round_time', 'time', 'seconds', 'wall', 'round_seconds'}
def rows(d, f):
  out = []
  for line in open(f'{d}/{f}'):
    r = json.loads(line)
    out.append({k: v for k, v in r.items() if not any(t in k for t in ('time', 'elapsed', 'second', 'wall'))})
  return out
for f in ('metrics.jsonl', 'clients.jsonl'):
  ra, rb = rows(a, f), rows(b, f)
  print(f, len(ra), 'rows, identical:', ra == rb)
print('metrics keys dropped:', sorted(set(json.loads(open(f'{a}/metrics.jsonl').readline())) - set(rows(a, 'metrics.jsonl')[0])))
from fedjax_mr.harness import experiment
def state(d):
  r = experiment.load_run(d)
  return r.round, jax.device_get(r.state)
ra, sa = state(a); rb, sb = state(b)
la, ta = jax.tree.flatten(sa); lb, tb = jax.tree.flatten(sb)
print('rounds', ra, rb, 'same tree', ta == tb, 'leaves', len(la))
same = all(x.dtype == y.dtype and x.shape == y.shape and np.array_equal(np.asarray(x).reshape(-1).view(np.uint8), np.asarray(y).reshape(-1).view(np.uint8)) for x, y in zip(la, lb))
print('final state bit-identical:', same, 'digest', checkpoint.digest(sa, {}) == checkpoint.digest(sb, {}))
print('client-state bytes', sum(x.nbytes for x in jax.tree.leaves(sa.clients)))
