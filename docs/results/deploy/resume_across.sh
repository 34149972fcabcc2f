#!/usr/bin/env bash
# Issue 73's "done means" 3: a workdir written by the programs at the
# issue's start (d416721), resumed by this commit's programs.
#
# Training runs (the issue's flags; FedAvg, and SCAFFOLD, whose per-client
# controls are in the checkpoint): d416721 runs round 1 of 2, this commit
# resumes the workdir to round 2; compared with this commit's and with
# d416721's uninterrupted runs: every metrics and clients row (times
# aside) and every leaf of the final state, bit for bit, and where they
# differ, by how much.
# FedStitch (a small pool of cnn_mnist and cnn_femnist, 6 clients): a
# d416721 run stopped by SIGTERM after its first round, resumed by this
# commit, against this commit's uninterrupted run: the networks of
# results.json and every log row (times aside).
# The old code runs from a git worktree of d416721 (its own fedjax_mr
# first on sys.path); everything in a temporary folder, removed at the end.
#
#   bash docs/results/deploy/resume_across.sh > docs/results/deploy/resume_across.txt
set -u
cd "$(dirname "$0")/../../.."
PY=$PWD/${PYTHON:-.venv/bin/python}
START=d416721
V=$(mktemp -d /tmp/resume_across_XXXXXX)
trap 'git worktree remove --force "$V/start" >/dev/null 2>&1; rm -rf "$V"' EXIT
git worktree add -q "$V/start" $START
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs"
echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- fedjax_mr experiments || echo -dirty); the issue's start: $START"
echo "date: $(date -u +%FT%TZ)"

compare() {  # two training workdirs
  $PY docs/results/deploy/compare_runs.py resume "$1" "$2"
}

BASE="--partition=iid --num_clients=12 --clients_per_round=3 --local_epochs=1"
BASE="$BASE --eval_every=1 --seed=3"
for alg in fedavg scaffold; do
  echo "== $alg"
  (cd "$V/start" && $PY -m experiments.run $BASE --algorithm=$alg --rounds=1 \
    --workdir=$V/old_$alg > $V/old_$alg.log 2>&1)
  echo "  $START, round 1: exit $?"
  $PY -m experiments.run $BASE --algorithm=$alg --rounds=2 \
    --workdir=$V/old_$alg >> $V/old_$alg.log 2>&1
  echo "  this commit resumes it to round 2: exit $?"
  $PY -m experiments.run $BASE --algorithm=$alg --rounds=2 \
    --workdir=$V/new_$alg > $V/new_$alg.log 2>&1
  echo "  this commit uninterrupted: exit $?"
  (cd "$V/start" && $PY -m experiments.run $BASE --algorithm=$alg --rounds=2 \
    --workdir=$V/start_$alg > $V/start_$alg.log 2>&1)
  echo "  $START uninterrupted: exit $?"
  echo "  resumed against this commit's uninterrupted run:"
  compare "$V/old_$alg" "$V/new_$alg"
  echo "  resumed against $START's uninterrupted run:"
  compare "$V/old_$alg" "$V/start_$alg"
done

echo "== fedstitch"
$PY -m experiments.pretrain_zoo --models=cnn_mnist,cnn_femnist \
  --public_size=500 --epochs=3 --workdir=$V/pool > $V/pool.log 2>&1
echo "  pool: exit $?"
STITCH="--pool=$V/pool --num_clients=6 --clients_per_round=3"
STITCH="$STITCH --rounds_per_selection=2 --batch_size=32 --eval_examples=200"
(cd "$V/start" && exec $PY -u -m experiments.stitch $STITCH \
  --workdir=$V/stitch_old > $V/stitch_old.log 2>&1) &
pid=$!
until grep -q '^round   1 ' $V/stitch_old.log 2>/dev/null || ! kill -0 $pid 2>/dev/null; do
  sleep 0.2
done
kill -TERM $pid 2>/dev/null
wait $pid
echo "  $START stopped by SIGTERM: exit $?; $(grep -o 'state after round [0-9]*' $V/stitch_old.log | tail -1); state.npz $([ -f $V/stitch_old/state.npz ] && echo present || echo absent)"
$PY -m experiments.stitch $STITCH --workdir=$V/stitch_old > $V/stitch_again.log 2>&1
echo "  this commit resumes it: exit $?, its first line of progress: $(grep -m1 '^round' $V/stitch_again.log | cut -c1-40)"
$PY -m experiments.stitch $STITCH --workdir=$V/stitch_new > $V/stitch_new.log 2>&1
echo "  this commit uninterrupted: exit $?"
$PY - "$V/stitch_old" "$V/stitch_new" <<'PYEOF'
import json, sys
TIMES = ('time', 'elapsed', '_s')
def timeless(v):
  if isinstance(v, dict):
    return {k: timeless(x) for k, x in v.items() if not any(t in k for t in TIMES)}
  if isinstance(v, list):
    return [timeless(x) for x in v]
  return v
a, b = sys.argv[1:]
la = [timeless(json.loads(l)) for l in open(f'{a}/log.jsonl')]
lb = [timeless(json.loads(l)) for l in open(f'{b}/log.jsonl')]
print(f'    log.jsonl: {len(la)} and {len(lb)} rows, equal {la == lb}')
na = json.load(open(f'{a}/results.json'))['networks']
nb = json.load(open(f'{b}/results.json'))['networks']
print(f'    results.json networks: {len(na)} and {len(nb)}, equal {na == nb}')
PYEOF
