#!/usr/bin/env bash
# Issue 75's cost of a secure round on a real Flower federation: the
# README's main job (FedAvg, Fashion-MNIST, Dir(0.1), 100 clients, 10 a
# round, cnn_mnist, E 5, B 50) deployed on 3 local SuperNodes (TLS, node
# authentication, `experiments.deploy`), 4 rounds plain and 4 with
# --secure_aggregation (SecAgg, every other client a neighbour); each
# round's time from metrics.jsonl (round 1 compiles: left out of the
# medians).
#
#   bash docs/results/secure/flower.sh > docs/results/secure/flower.txt 2>&1
set -u
cd "$(dirname "$0")/../../.."
PY=${PYTHON:-.venv/bin/python}
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; commit $(git rev-parse --short HEAD)"
rm -rf runs/secure_flower
for mode in plain secure; do
  extra=""
  [ $mode = secure ] && extra="--secure_aggregation"
  $PY -m experiments.deploy --nodes=3 \
    --flagfile=experiments/configs/default.flags --rounds=4 $extra \
    --workdir=runs/secure_flower/$mode > runs/secure_flower_$mode.log 2>&1 \
    || { echo "$mode failed:"; tail -5 runs/secure_flower_$mode.log; }
done
$PY - <<'PY'
import json, statistics
times = {}
for mode in ('plain', 'secure'):
  rows = [json.loads(l) for l in open(f'runs/secure_flower/{mode}/metrics.jsonl')]
  times[mode] = statistics.median(r['round_time_s'] for r in rows[1:])
  acc = rows[-1]['test_accuracy']
  print(f'{mode}: rounds 2-4 median {times[mode]:.2f} s a round; test accuracy after 4 rounds {acc:.4f}')
print(f'secure / plain: {times["secure"] / times["plain"]:.2f}x')
PY
