#!/usr/bin/env bash
# Issue 73's "done means" 1, by the programs as a user runs them (a
# program's XLA flags), at this machine's default placement (no
# --num_devices: one host device per core, at most K):
#
#   bash docs/results/deploy/placement.sh > docs/results/deploy/placement.txt
#
# The flags the issue measured (FedAvg: rows equal in round 1, not in
# round 2, before the engine's fold) with `experiments.run` and
# `experiments.deploy --nodes=3`; then the same with --client_chunk=2 for
# FedAvg, FedProx, FedMut, SCAFFOLD, FedExP and FedMR. Every metrics and
# clients row (times aside) and every leaf of the final model compared bit
# for bit; the runs are in a temporary folder, removed at the end.
set -u
cd "$(dirname "$0")/../../.."
PY=${PYTHON:-.venv/bin/python}
V=$(mktemp -d /tmp/deploy_placement_XXXXXX)
trap 'rm -rf "$V"' EXIT
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs"
echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- fedjax_mr experiments || echo -dirty)"
echo "date: $(date -u +%FT%TZ)"
echo "default placement: $(nproc) host devices (one per core, at most K = 3)"
BASE="--partition=iid --num_clients=12 --clients_per_round=3 --local_epochs=1"
BASE="$BASE --eval_every=1 --seed=3 --rounds=2"

compare_runs() {  # simulated deployed
  $PY docs/results/deploy/compare_runs.py placement "$1" "$2"
}

pair() {  # name, flags
  echo "== $1: $2"
  $PY -m experiments.run $BASE $2 --workdir=$V/sim_$1 > $V/sim_$1.log 2>&1
  echo "  experiments.run exit $?"
  $PY -m experiments.deploy --nodes=3 $BASE $2 --workdir=$V/dep_$1 \
    > $V/dep_$1.log 2>&1
  echo "  experiments.deploy exit $?"
  compare_runs $V/sim_$1 $V/dep_$1
}

pair fedavg "--algorithm=fedavg"
for alg in fedavg fedprox fedmut scaffold fedexp fedmr; do
  pair ${alg}_chunk2 "--algorithm=$alg --client_chunk=2"
done
