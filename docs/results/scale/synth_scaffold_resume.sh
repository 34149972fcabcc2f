#!/bin/bash
# SCAFFOLD on Synthetic(1, 1), 10^6 clients, K = 10^4, per-client controls in host memory:
# killed (kill -9) during round 3, resumed, compared with the uninterrupted run in /tmp/synth/sc.
cd /work/main
PY=/work/main/.venv/bin/python
W=/tmp/synth_sc_resume; rm -rf $W
A="--dataset=synthetic --model=logistic --num_clients=1000000 --clients_per_round=10000 --rounds=3 --algorithm=scaffold --checkpoint_every=1"
$PY -m experiments.run $A --workdir=$W > /work/scale/sc_resume_first.log 2>&1 &
P=$!
# kill -9 once round 2 is in metrics.jsonl (during round 3)
while [ "$(wc -l < $W/metrics.jsonl 2>/dev/null || echo 0)" -lt 2 ]; do sleep 1; done
sleep 3; kill -9 $P; wait $P 2>/dev/null
echo "killed after $(wc -l < $W/metrics.jsonl) rows" >> /work/scale/sc_resume_first.log
/usr/bin/time -v $PY -m experiments.run $A --workdir=$W > /work/scale/sc_resume_second.log 2>&1
$PY - <<'PY' > /work/scale/sc_resume_compare.log 2>&1
import json
import jax, numpy as np
from fedjax_mr.harness import experiment
a = experiment.load_run('/tmp/synth/sc')
b = experiment.load_run('/tmp/synth_sc_resume')
for part in ('server', 'clients'):
  la = jax.tree.leaves(jax.device_get(getattr(a.state, part)))
  lb = jax.tree.leaves(jax.device_get(getattr(b.state, part)))
  same = len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))
  print(f'final {part} state bit-identical:', same, len(la), 'leaves', [x.shape for x in la])
ra = [json.loads(l) for l in open('/tmp/synth/sc/metrics.jsonl')]
rb = [json.loads(l) for l in open('/tmp/synth_sc_resume/metrics.jsonl')]
drop = lambda r: {k: v for k, v in r.items() if not k.endswith('_s')}
print('metrics rows identical (times left out):', [drop(x) for x in ra] == [drop(x) for x in rb])
ca = [json.loads(l) for l in open('/tmp/synth/sc/clients.jsonl')]
cb = [json.loads(l) for l in open('/tmp/synth_sc_resume/clients.jsonl')]
print('clients rows identical:', ca == cb)
PY
cat /work/scale/sc_resume_compare.log
