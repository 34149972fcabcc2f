#!/bin/bash
cd /work/synth
PY=/work/main/.venv/bin/python
W=/tmp/synth_resume; rm -rf $W
A="--dataset=synthetic --model=logistic --num_clients=1000000 --clients_per_round=10000 --rounds=3 --checkpoint_every=1"
$PY -m experiments.run $A --workdir=$W > /work/scale/resume_first.log 2>&1 &
P=$!
# kill -9 once round 2 is in metrics.jsonl (during round 3)
while [ "$(wc -l < $W/metrics.jsonl 2>/dev/null || echo 0)" -lt 2 ]; do sleep 1; done
sleep 3; kill -9 $P; wait $P 2>/dev/null
echo "killed after $(wc -l < $W/metrics.jsonl) rows" >> /work/scale/resume_first.log
$PY -m experiments.run $A --workdir=$W > /work/scale/resume_second.log 2>&1
$PY - <<'PY' > /work/scale/resume_compare.log 2>&1
import jax, numpy as np
from fedjax_mr.harness import experiment
a = experiment.load_run('/tmp/synth_fedavg')
b = experiment.load_run('/tmp/synth_resume')
la = jax.tree.leaves(jax.device_get(a.state.server)); lb = jax.tree.leaves(jax.device_get(b.state.server))
same = all(np.array_equal(x, y) for x, y in zip(la, lb))
print('final server state bit-identical:', same, len(la), 'leaves')
import json
ra = [json.loads(l) for l in open('/tmp/synth_fedavg/metrics.jsonl')]
rb = [json.loads(l) for l in open('/tmp/synth_resume/metrics.jsonl')]
drop = lambda r: {k: v for k, v in r.items() if not k.endswith('_s')}
print('metrics rows identical (times left out):', [drop(x) for x in ra] == [drop(x) for x in rb])
PY
