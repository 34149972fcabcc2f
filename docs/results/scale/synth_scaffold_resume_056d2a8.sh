#!/bin/bash
# SCAFFOLD on Synthetic(1, 1), 10^6 clients, K = 10^4, controls in host memory, at 056d2a8:
# killed (kill -9) during round 3, resumed under /usr/bin/time -v, compared with the
# uninterrupted run of synth_scaffold_host_056d2a8.txt (workdir /tmp/mem/sc6).
cd /work/wt_mem
PY=/work/wt_mem/.venv/bin/python
R=docs/results/scale
W=/tmp/mem/sc_resume; rm -rf $W
A="--dataset=synthetic --model=logistic --num_clients=1000000 --clients_per_round=10000 --rounds=3 --algorithm=scaffold --checkpoint_every=1"
$PY -m experiments.run $A --workdir=$W > $R/synth_scaffold_resume_first_056d2a8.txt 2>&1 &
P=$!
# kill -9 once round 2 is in metrics.jsonl (during round 3)
while [ "$(wc -l < $W/metrics.jsonl 2>/dev/null || echo 0)" -lt 2 ]; do sleep 1; done
sleep 3; kill -9 $P; wait $P 2>/dev/null
echo "killed after $(wc -l < $W/metrics.jsonl) rows" >> $R/synth_scaffold_resume_first_056d2a8.txt
/usr/bin/time -v $PY -m experiments.run $A --workdir=$W > $R/synth_scaffold_resume_second_056d2a8.txt 2>&1
$PY - <<'PY' > $R/synth_scaffold_resume_compare_056d2a8.txt 2>&1
import json
import jax, numpy as np
from fedjax_mr.harness import experiment
a = experiment.load_run('/tmp/mem/sc6')
b = experiment.load_run('/tmp/mem/sc_resume')
for part in ('server', 'clients'):
  la = jax.tree.leaves(jax.device_get(getattr(a.state, part)))
  lb = jax.tree.leaves(jax.device_get(getattr(b.state, part)))
  same = len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))
  print(f'final {part} state bit-identical:', same, len(la), 'leaves', [x.shape for x in la])
ra = [json.loads(l) for l in open('/tmp/mem/sc6/metrics.jsonl')]
rb = [json.loads(l) for l in open('/tmp/mem/sc_resume/metrics.jsonl')]
drop = lambda r: {k: v for k, v in r.items() if not k.endswith('_s')}
print('metrics rows identical (times left out):', [drop(x) for x in ra] == [drop(x) for x in rb])
ca = [json.loads(l) for l in open('/tmp/mem/sc6/clients.jsonl')]
cb = [json.loads(l) for l in open('/tmp/mem/sc_resume/clients.jsonl')]
print('clients rows identical:', ca == cb)
PY
cat $R/synth_scaffold_resume_compare_056d2a8.txt
