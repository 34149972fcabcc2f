#!/usr/bin/env bash
# Issue 57's "done means", by the programs as a user runs them (a
# program's XLA flags, not the test suite's), on the embedded default
# (Fashion-MNIST, experiments/configs/default.flags):
#
#   bash docs/results/deploy/equality.sh > docs/results/deploy/equality.txt
#
# 1. FedAvg, FedMR, FedMut and SCAFFOLD, 2 rounds: `experiments.run` and
#    `experiments.deploy --nodes=3` (a SuperLink and 3 SuperNodes as
#    processes, TLS, node authentication), both `--num_devices=1
#    --client_chunk=1`; every metrics and clients row (times aside) and
#    every leaf of the final model compared bit for bit.
# 2. The FedAvg deploy command SIGKILLed once round 1 is written (3
#    rounds), no process of it left, the same command again: equal to the
#    uninterrupted `experiments.run`.
# 3. FedStitch: a pool of three zoo models (`experiments.pretrain_zoo`, 1
#    epoch), then `experiments.stitch` and `experiments.deploy_stitch
#    --nodes=3` with the same flags; the log, the energy records and
#    results.json (times aside) and the stitched networks compared.
# The runs are in a temporary folder, removed at the end.
set -u
cd "$(dirname "$0")/../../.."
PY=${PYTHON:-.venv/bin/python}
V=$(mktemp -d /tmp/deploy_equality_XXXXXX)
trap 'rm -rf "$V"' EXIT
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs"
echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- fedjax_mr experiments || echo -dirty)"
echo "date: $(date -u +%FT%TZ)"
BASE="--flagfile=experiments/configs/default.flags --num_devices=1 --client_chunk=1"

compare_runs() {  # simulated deployed
  $PY docs/results/deploy/compare_runs.py equality "$1" "$2"
}

for alg in fedavg fedmr fedmut scaffold; do
  echo "== $alg, 2 rounds"
  $PY -m experiments.run $BASE --rounds=2 --algorithm=$alg \
    --workdir=$V/sim_$alg > $V/sim_$alg.log 2>&1
  echo "  experiments.run exit $?"
  $PY -m experiments.deploy --nodes=3 $BASE --rounds=2 --algorithm=$alg \
    --workdir=$V/dep_$alg > $V/dep_$alg.log 2>&1
  echo "  experiments.deploy exit $?"
  compare_runs $V/sim_$alg $V/dep_$alg
done

echo "== fedavg, 3 rounds, the deploy command SIGKILLed after round 1"
$PY -m experiments.run $BASE --rounds=3 --algorithm=fedavg \
  --workdir=$V/sim3 > $V/sim3.log 2>&1
$PY -m experiments.deploy --nodes=3 $BASE --rounds=3 --algorithm=fedavg \
  --workdir=$V/kill > $V/kill1.log 2>&1 &
P=$!
until [ -s $V/kill/metrics.jsonl ] || ! kill -0 $P 2>/dev/null; do sleep 0.2; done
kill -9 $P
wait $P
echo "  killed: exit $?, rows written $(wc -l < $V/kill/metrics.jsonl)"
sleep 5
echo "  processes left naming the workdir 5 s later: $(pgrep -f "$V/kill" | wc -l)"
$PY -m experiments.deploy --nodes=3 $BASE --rounds=3 --algorithm=fedavg \
  --workdir=$V/kill > $V/kill2.log 2>&1
echo "  the same command again: exit $?, '$(grep -m1 resuming $V/kill2.log)'"
compare_runs $V/sim3 $V/kill

echo "== FedStitch"
$PY -m experiments.pretrain_zoo --models=cnn_mnist,cnn_femnist,cnn_fedavg \
  --epochs=1 --workdir=$V/pool > $V/pool.log 2>&1
echo "  experiments.pretrain_zoo exit $?"
S="--pool=$V/pool --num_clients=20 --clients_per_round=6"
S="$S --rounds_per_selection=2 --max_depth=3 --local_clients=2"
$PY -m experiments.stitch $S --workdir=$V/stitch > $V/stitch.log 2>&1
echo "  experiments.stitch exit $?"
$PY -m experiments.deploy_stitch --nodes=3 $S --workdir=$V/stitch_dep \
  > $V/stitch_dep.log 2>&1
echo "  experiments.deploy_stitch exit $?"
$PY - $V/stitch $V/stitch_dep <<'EOF'
import json, sys
import numpy as np
a, b = sys.argv[1:]
def timeless(x):
  if isinstance(x, dict):
    return {k: timeless(v) for k, v in x.items()
            if 'seconds' not in k and not k.endswith('_time_s')
            and k != 'peak_host_mib'}
  if isinstance(x, list):
    return [timeless(v) for v in x]
  return x
def lines(d, name):
  with open(f'{d}/{name}') as f:
    return [timeless(json.loads(l)) for l in f]
for name in ('log.jsonl', 'energy.jsonl'):
  x, y = lines(a, name), lines(b, name)
  print(f'  {name}: {len(x)} and {len(y)} rows, equal {x == y}')
with open(f'{a}/results.json') as f, open(f'{b}/results.json') as g:
  x, y = timeless(json.load(f)), timeless(json.load(g))
print(f'  results.json equal: {x == y}'
      + ('' if x == y else f'; differ: {[k for k in x if x[k] != y.get(k)]}'))
with np.load(f'{a}/networks.npz') as p, np.load(f'{b}/networks.npz') as q:
  same = sorted(p.files) == sorted(q.files) and all(
    np.array_equal(p[k], q[k]) for k in p.files)
  print(f'  networks.npz: {len(p.files)} arrays, bit-equal {same}')
EOF
grep -m3 -i "best\|stitched" $V/stitch_dep.log | sed 's/^/  deployed: /'
