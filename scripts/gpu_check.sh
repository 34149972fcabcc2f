#!/bin/bash
# The prepared device call: every GPU figure the scale issue asks for, in
# priority order, in one call of at most BUDGET seconds (docs/results/scale.md,
# "Benchmark"; docs/howto/gpu.md, "The project's GPU check").
#
#   OUT=/some/folder scripts/gpu_check.sh           # on the lent GPU
#   OUT=/some/folder scripts/gpu_check.sh --tiny    # every item, tiny, on CPU
#
# Items run one after another, each under `timeout` (ITEM_LIMIT seconds,
# or its own), each an `experiments.benchmark` process on random data of
# the datasets' shapes (`--random_data`; the machine has no datasets and
# no network). An item is skipped once less than MIN_LEFT seconds of
# BUDGET remain. As soon as an item ends, its whole output becomes
# <nn>_<item>.txt in $OUT/items.tar.gz (the device tool returns at most 8
# files), its figures are appended to $OUT/summary.tsv and printed; the
# running item writes $OUT/current.txt, so a call cut short keeps what it
# had. $OUT/header.txt: the GPU (nvidia-smi), the Python packages' versions,
# the commit. The last lines printed are the summary.
#
# Python: .venv/bin/python where there is one, else python3 (on the lent
# machines /opt/torch/.venv/bin/python3, which holds jax[cuda], flax,
# optax, orbax and torch; nothing can be installed there from a registry).
# PY overrides it. Wheels carried in .whl/ (see the device README) are
# installed into /tmp/gpu_check_site first, with no index. The repository
# root goes on PYTHONPATH: nothing is installed for fedjax_mr itself.
#
# Environment: OUT (required), TINY=1 (or --tiny), BUDGET (seconds, 300;
# tiny 7200), ITEM_LIMIT (60, more for the heavier items; tiny 900),
# MIN_LEFT (20), ROUNDS (timed rounds, 2; tiny 1), ITEMS (item names without their number, e.g.
# 'papers_vgg16 fedmr_K100'; default all), DET_MODEL (the determinism
# item's model, resnet20), COMMIT (the commit to record where the copy has
# no .git), PY.
set -u
[[ ${1:-} == --tiny ]] && TINY=1
TINY=${TINY:-0}
: "${OUT:?set OUT to the folder for the results}"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/items"

if [[ $TINY == 1 ]]; then
  BUDGET=${BUDGET:-7200} ROUNDS=${ROUNDS:-1} ITEM_LIMIT=${ITEM_LIMIT:-900}
else
  BUDGET=${BUDGET:-300} ROUNDS=${ROUNDS:-2} ITEM_LIMIT=${ITEM_LIMIT:-60}
fi
MIN_LEFT=${MIN_LEFT:-20}
ITEMS=${ITEMS:-all}
START=$(date +%s)

if [[ -z ${PY:-} ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if compgen -G '.whl/*.whl' > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/gpu_check_site .whl/*.whl \
    && export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
# JAX takes this share of GPU memory up front (75 % by default); the
# PyTorch loop in the same process needs the rest.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.6}
BASE_XLA_FLAGS=${XLA_FLAGS:-}

header() {
  echo "date: $(date -u +%FT%TZ); tiny: $TINY; budget: ${BUDGET}s; rounds: $ROUNDS"
  echo "commit: ${COMMIT:-$(git rev-parse HEAD 2> /dev/null || echo 'unknown (no .git)')}"
  echo "tree sha256 (fedjax_mr, experiments, scripts): $(
    find fedjax_mr experiments scripts -name '*.py' -o -name '*.sh' \
      | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)"
  echo "python: $PY ($("$PY" --version 2>&1))"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
    --format=csv 2>&1 || echo 'nvidia-smi: none'
  "$PY" - << 'EOF' 2>&1
import importlib.metadata as md
for name in ('jax', 'jaxlib', 'jax-cuda12-plugin', 'jax-cuda13-plugin',
             'flax', 'optax', 'orbax-checkpoint', 'numpy', 'torch'):
  try:
    print(f'{name} {md.version(name)}')
  except md.PackageNotFoundError:
    print(f'{name}: not installed')
import jax
print('jax devices:', jax.devices())
try:
  import torch
  print('torch cuda:', torch.version.cuda, torch.cuda.is_available(),
        'TF32 defaults: matmul', torch.backends.cuda.matmul.allow_tf32,
        'cudnn', torch.backends.cudnn.allow_tf32)
except ImportError:
  print('torch: not importable')
import experiments.benchmark  # noqa: F401  the programs import here
print('experiments.benchmark imports')
EOF
}
header > "$OUT/header.txt"
cat "$OUT/header.txt"
printf 'item\trc\tseconds\tline\n' > "$OUT/summary.tsv"

# Sizes: the papers' setting (K = 10 of N = 100 clients of 500 examples,
# E = 5, B = 50) and the large cohorts (K = N clients of 10-50 examples,
# E = 1, B = 10), or their tiny stand-ins.
if [[ $TINY == 1 ]]; then
  PAPERS="--num_clients=4 --clients_per_round=2 --local_epochs=1 --batch_size=5 --random_train_size=40"
  CHUNKS=1,2 ALL=2 COHORTS='4 8 16' FEDMR_K=4 SIZES='--min_client_size=2 --max_client_size=5' B=2
else
  PAPERS='--num_clients=100 --clients_per_round=10 --local_epochs=5 --batch_size=50'
  CHUNKS=1,5,10 ALL=10 COHORTS='100 1000 10000' FEDMR_K=100 SIZES='' B=10
fi
BENCH="-m experiments.benchmark --random_data --rounds=$ROUNDS --num_devices=1"
# Tiny: no matmul peak (10 s a process on 2 CPU cores), and XLA:CPU's
# faster-compiling flags, as the test suite compiles (tests/xla_flags.py).
if [[ $TINY == 1 ]]; then
  BENCH="$BENCH --nopeak"
  BASE_XLA_FLAGS="$BASE_XLA_FLAGS --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
fi
CIFAR='--dataset=cifar10'
FMNIST='--dataset=fashion_mnist'

# Lines worth a summary row: each setting's, the ratios, PyTorch's TF32
# settings, memory, and a failure's last words.
KEEP='^\[|ratio:|^PyTorch|^peak|^per-client|identical bits|det/default|Error|error:'

finish() { # name rc seconds: file the item, summarise it
  local name=$1 rc=$2 secs=$3 n=0
  mv "$OUT/current.txt" "$WORK/items/$name.txt"
  (cd "$WORK/items" && tar czf "$OUT/items.tar.gz.tmp" ./*.txt) \
    && mv "$OUT/items.tar.gz.tmp" "$OUT/items.tar.gz"
  while IFS= read -r line; do
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$line" >> "$OUT/summary.tsv"
    n=$((n + 1))
  done < <(grep -E "$KEEP" "$WORK/items/$name.txt" | cut -c1-400)
  if ((n == 0)); then
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" \
      "$(tail -n 1 "$WORK/items/$name.txt" | cut -c1-400)" >> "$OUT/summary.tsv"
  fi
  echo "== $name rc=$rc ${secs}s"
  grep -E "$KEEP" "$WORK/items/$name.txt" | cut -c1-300
}

NN=0
item() { # name limit_s command...: one timed item, unless the budget is spent
  local name limit now left rc
  NN=$((NN + 1))
  name=$(printf '%02d_%s' "$NN" "$1")
  limit=$2
  shift 2
  if [[ $ITEMS != all && " $ITEMS " != *" ${name#??_} "* ]]; then return; fi
  now=$(date +%s)
  left=$((BUDGET - (now - START)))
  if ((left < MIN_LEFT)); then
    printf '%s\tskipped\t0\t%s\n' "$name" "budget spent (${left}s left)" >> "$OUT/summary.tsv"
    echo "== $name skipped (budget spent)"
    return
  fi
  ((limit > left)) && limit=$left
  echo "## $name: $* (limit ${limit}s)" > "$OUT/current.txt"
  # `timeout` runs programs, not functions: the exported ones run in bash.
  timeout -k 10 "$limit" bash -c '"$@"' _ "$@" >> "$OUT/current.txt" 2>&1
  rc=$?
  ((rc == 124 || rc == 137)) && echo "timed out after ${limit}s" >> "$OUT/current.txt"
  finish "$name" "$rc" $(($(date +%s) - now))
}

bench() { XLA_FLAGS=$BASE_XLA_FLAGS "$PY" $BENCH "$@"; }

determinism() { # model-and-setting flags: default, deterministic twice
  local args=("$@") sha=() secs=() i flags
  for i in default det det; do
    flags=$BASE_XLA_FLAGS
    [[ $i == det ]] && flags="$flags --xla_gpu_deterministic_ops=true"
    echo "# $i: XLA_FLAGS=$flags"
    XLA_FLAGS=$flags "$PY" $BENCH "${args[@]}" > "$WORK/det.txt" 2>&1
    cat "$WORK/det.txt"
    sha+=("$(grep -oE 'state sha256 [0-9a-f]+' "$WORK/det.txt" | head -1)")
    secs+=("$(grep -oE '\| round [0-9.]+s' "$WORK/det.txt" | head -1 | grep -oE '[0-9.]+')")
  done
  if [[ -n ${sha[1]} && ${sha[1]} == "${sha[2]}" ]]; then
    echo "deterministic runs: identical bits (${sha[1]}); default run: ${sha[0]}"
  else
    echo "deterministic runs: NOT identical bits (${sha[1]} vs ${sha[2]})"
  fi
  "$PY" -c "import sys; d, a, b = map(float, sys.argv[1:4]); print(
    f'det/default round time: {a / d:.3f}, {b / d:.3f} '
    f'(default {d:.4f}s, deterministic {a:.4f}s, {b:.4f}s)')" \
    "${secs[0]:-nan}" "${secs[1]:-nan}" "${secs[2]:-nan}"
}

export PY BENCH BASE_XLA_FLAGS WORK
export -f bench determinism

# 1. The papers' setting: sequential, chunks and all vmapped in one
#    process, each against the PyTorch loop on the same clients.
item papers_cnn_cifar "$ITEM_LIMIT" bench $CIFAR --model=cnn_cifar $PAPERS --client_chunks=$CHUNKS
item papers_resnet20 $((ITEM_LIMIT + 30)) bench $CIFAR --model=resnet20 $PAPERS --client_chunks=$CHUNKS
item papers_vgg16 $((ITEM_LIMIT + 90)) bench $CIFAR --model=vgg16 $PAPERS --client_chunks=$CHUNKS
# 2. Large cohorts: K = N clients of 10-50 examples, E = 1, B = 10, against
#    the same samples trained centrally in batches of K × B.
for model in cnn_mnist resnet20; do
  data=$FMNIST
  [[ $model == resnet20 ]] && data=$CIFAR
  for k in $COHORTS; do
    item "cohort_${model}_K$k" "$ITEM_LIMIT" bench $data --model=$model \
      --sizes=range $SIZES --num_clients=$k --clients_per_round=$k \
      --local_epochs=1 --batch_size=$B --limit_batch=$((k * B)) --nopytorch
  done
done
# 3. Precision: float32 with TF32 (JAX's default) is item 2's all-vmapped
#    setting; here full float32 and bfloat16 compute, both sides alike.
item precision_highest_resnet20 "$ITEM_LIMIT" bench $CIFAR --model=resnet20 $PAPERS \
  --client_chunk=$ALL --matmul_precision=highest
item precision_bf16_resnet20 "$ITEM_LIMIT" bench $CIFAR --model=resnet20 $PAPERS \
  --client_chunk=$ALL --compute_dtype=bfloat16
# 4. Determinism: --xla_gpu_deterministic_ops=true twice, the default once.
DET_MODEL=${DET_MODEL:-resnet20}
item "determinism_$DET_MODEL" $((ITEM_LIMIT + 60)) determinism $CIFAR --model=$DET_MODEL \
  $PAPERS --client_chunk=$ALL --nopytorch --nolimit
# 5. FedMR's recombination and FedMut's mutation at K = 100: the server's
#    share of the round (FedAvg timed beside each).
for alg in fedmr fedmut; do
  item "${alg}_K$FEDMR_K" "$ITEM_LIMIT" bench $CIFAR --model=cnn_cifar --algorithm=$alg \
    $PAPERS --num_clients=$FEDMR_K --clients_per_round=$FEDMR_K --nopytorch --nolimit
done

echo "== done in $(($(date +%s) - START))s of ${BUDGET}s; summary ($OUT/summary.tsv):"
cut -f1-3 "$OUT/summary.tsv" | uniq
