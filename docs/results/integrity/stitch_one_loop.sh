#!/usr/bin/env bash
# Issue 73 item 3: FedStitch runs in the host loop of every run (config.json,
# metrics.jsonl and clients.jsonl with digests, a checkpoint per round),
# against the code before it (the session's start, c3ba94a: state.npz and
# log.jsonl). A small pool (cnn_mnist and cnn_femnist, 3 epochs on 500
# public Fashion-MNIST examples), 6 clients, 3 a round:
# 1. c3ba94a's uninterrupted run against this commit's: results.json,
#    log.jsonl, energy.jsonl, networks.npz and the final state document
#    (c3ba94a's state.npz, this commit's newest checkpoint) bit for bit,
#    times aside (every array by its bytes);
# 2. a c3ba94a run stopped by SIGTERM after its second round (state.npz),
#    resumed by this commit (imported), against this commit's
#    uninterrupted run, the records too;
# 3. this commit stopped by SIGTERM after its second round and resumed.
# The old code runs from a git worktree (its own fedjax_mr first on
# sys.path); everything in a temporary folder, removed at the end.
#
#   bash docs/results/integrity/stitch_one_loop.sh > docs/results/integrity/stitch_one_loop.txt
set -u
cd "$(dirname "$0")/../../.."
PY=$PWD/${PYTHON:-.venv/bin/python}
OLD=c3ba94a
V=$(mktemp -d /tmp/stitch_loop_XXXXXX)
trap 'git worktree remove --force "$V/old" >/dev/null 2>&1; rm -rf "$V"' EXIT
git worktree add -q "$V/old" $OLD
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs"
echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- fedjax_mr experiments || echo -dirty); before: $OLD"
echo "date: $(date -u +%FT%TZ)"

$PY -m experiments.pretrain_zoo --models=cnn_mnist,cnn_femnist \
  --public_size=500 --epochs=3 --workdir=$V/pool > $V/pool.log 2>&1
echo "pool: exit $?"
STITCH="--pool=$V/pool --num_clients=6 --clients_per_round=3"
STITCH="$STITCH --rounds_per_selection=2 --batch_size=32 --eval_examples=200"
STITCH="$STITCH --local_clients=1"

stop_early() {  # stop_early <dir to run in> <workdir>: SIGTERM after the second round
  (cd "$1" && exec $PY -u -m experiments.stitch $STITCH --workdir=$2 \
    > $2.log 2>&1) &
  local pid=$!
  until grep -q '^round   2 ' $2.log 2>/dev/null || ! kill -0 $pid 2>/dev/null; do
    sleep 0.05
  done
  kill -TERM $pid 2>/dev/null
  wait $pid
  echo "  stopped by SIGTERM: exit $?; $(grep -o 'interrupted: .* holds the state after round [0-9]*' $2.log | head -1)"
}

(cd "$V/old" && $PY -m experiments.stitch $STITCH --workdir=$V/old_whole \
  > $V/old_whole.log 2>&1)
echo "$OLD uninterrupted: exit $?"
$PY -m experiments.stitch $STITCH --workdir=$V/new_whole > $V/new_whole.log 2>&1
echo "this commit uninterrupted: exit $?"
echo "== 1. $OLD against this commit"
$PY docs/results/integrity/stitch_runs.py $V/old_whole $V/new_whole

echo "== 2. a $OLD workdir resumed by this commit"
stop_early "$V/old" $V/old_cut
ls $V/old_cut | tr '\n' ' ' | sed 's/^/  files: /'; echo
$PY -m experiments.stitch $STITCH --workdir=$V/old_cut > $V/old_cut_resumed.log 2>&1
echo "  resumed: exit $?; $(grep -o 'state format.*: resumed' $V/old_cut_resumed.log)"
echo "  first round line: $(grep -m1 '^round' $V/old_cut_resumed.log | cut -c1-12)"
$PY docs/results/integrity/stitch_runs.py $V/old_cut $V/new_whole records

echo "== 3. this commit stopped and resumed"
stop_early "$PWD" $V/new_cut
$PY -m experiments.stitch $STITCH --workdir=$V/new_cut > $V/new_cut_resumed.log 2>&1
echo "  resumed: exit $?; $(grep -m1 '^resuming\|^round' $V/new_cut_resumed.log | cut -c1-40)"
$PY docs/results/integrity/stitch_runs.py $V/new_cut $V/new_whole records
