#!/usr/bin/env bash
# Why a deployed run with --client_chunk=2 does not yet equal
# experiments.run's (docs/results/deploy/placement.txt): FedMR's round-1
# client losses (each client's own training, nothing summed) of
# `experiments.run` at --client_chunk=1 and 2, and of `experiments.deploy
# --nodes=3` at 2, at this machine's default placement:
#
#   bash docs/results/deploy/placement_chunks.sh > docs/results/deploy/placement_chunks.txt
set -u
cd "$(dirname "$0")/../../.."
PY=${PYTHON:-.venv/bin/python}
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs"
echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- fedjax_mr experiments || echo -dirty)"
echo "date: $(date -u +%FT%TZ)"

V=$(mktemp -d /tmp/chunkcheck_XXXXXX); trap 'rm -rf "$V"' EXIT
B="--partition=iid --num_clients=12 --clients_per_round=3 --local_epochs=1 --eval_every=1 --seed=3 --rounds=1 --algorithm=fedmr"
for c in 1 2; do $PY -m experiments.run $B --client_chunk=$c --workdir=$V/sim$c > /dev/null 2>&1; echo "run chunk $c exit $?"; done
$PY -m experiments.deploy --nodes=3 $B --client_chunk=2 --workdir=$V/dep2 > /dev/null 2>&1; echo "deploy chunk 2 exit $?"
$PY - $V <<'PY'
import json, sys
v = sys.argv[1]
def losses(d):
  with open(f'{v}/{d}/clients.jsonl') as f:
    row = json.loads(f.readline())
  return [(c['id'], c['loss']) for c in row['clients']]
a, b, c = losses('sim1'), losses('sim2'), losses('dep2')
print('round 1 client losses (id, loss), FedMR (no sums: the models and losses are the clients\' own):')
print('  experiments.run --client_chunk=1:', a)
print('  experiments.run --client_chunk=2:', b)
print('  experiments.deploy --client_chunk=2:', c)
print('  run chunk 1 == run chunk 2:', a == b, '; deploy chunk 2 == run chunk 1:', c == a)
PY
