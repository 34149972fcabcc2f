#!/usr/bin/env bash
# Issue 55, item 1, from the command line: checkpoints/3 replaced by a copy
# of checkpoints/2, resumed with --rounds=4, against an uninterrupted run.
set -u
cd /work/main
PY=.venv/bin/python
F="--num_clients=20 --clients_per_round=4 --local_epochs=1 --checkpoint_every=1 --eval_every=1"
rm -rf /tmp/c55; mkdir -p /tmp/c55
$PY -m experiments.run $F --rounds=4 --workdir=/tmp/c55/ref > /tmp/c55/ref.out 2>&1
$PY -m experiments.run $F --rounds=3 --workdir=/tmp/c55/rb > /tmp/c55/rb1.out 2>&1
rm -rf /tmp/c55/rb/checkpoints/3 && cp -r /tmp/c55/rb/checkpoints/2 /tmp/c55/rb/checkpoints/3
$PY -m experiments.run $F --rounds=4 --workdir=/tmp/c55/rb > /tmp/c55/rb2.out 2>&1
echo "resume rc=$?"; head -3 /tmp/c55/rb2.out
$PY - <<'P'
import json
def rows(p):
  return [{k: v for k, v in json.loads(l).items() if not k.endswith('_s')} for l in open(p)]
for f in ('metrics.jsonl', 'clients.jsonl'):
  a, b = rows(f'/tmp/c55/ref/{f}'), rows(f'/tmp/c55/rb/{f}')
  print(f, 'equal' if a == b else 'DIFFER', len(a), len(b))
print('final accuracy', rows('/tmp/c55/ref/metrics.jsonl')[-1].get('test_accuracy'), rows('/tmp/c55/rb/metrics.jsonl')[-1].get('test_accuracy'))
P
