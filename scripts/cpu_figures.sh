#!/usr/bin/env bash
# Re-measures the CPU figures of the docs' "Scale and benchmarks" page that
# come from `experiments.benchmark` and `experiments.zoo_report`, writing one
# record per run into $OUT (default docs/results/scale/cpu/<date>): each
# starts with the commit, the CPU (lscpu's model name), the load average and
# the command, then the program's own output, then the load at its end.
# Needs the `bench` extra (PyTorch) for the PyTorch comparison. Runs at a
# raised priority when it may (root): other work on the machine then yields
# the cores, and each record's load lines say how much there was.
#
#   bash scripts/cpu_figures.sh             # everything, ~30 min on 2 cores
#   bash scripts/cpu_figures.sh zoo matrix  # some parts
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/results/scale/cpu/$(date -u +%Y-%m-%d)}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
NICE=()
if [ "$(id -u)" = 0 ]; then NICE=(nice -n -15); fi

record() {  # record NAME MODULE ARGS...
  local name=$1 module=$2
  shift 2
  {
    echo "# commit: $(git rev-parse HEAD)$(git diff --quiet HEAD -- fedjax_mr experiments || echo ' (modified)')"
    echo "# cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores"
    echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# load at start: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "# command: python -m $module $*"
    "${NICE[@]}" "$PY" -m "$module" "$@" 2>&1
    echo "# exit: $?"
    echo "# load at end: $(cut -d' ' -f1-3 /proc/loadavg)"
  } > "$OUT/$name.txt"
  echo "$OUT/$name.txt"
}

ALGORITHMS='fedprox scaffold fedexp clusamp fedgen moon fedasam fedsam fedmr fedmut'
PARTS=${*:-pytorch matrix algorithms zoo}
for part in $PARTS; do
  case $part in
    pytorch)
      record pytorch_1device experiments.benchmark --num_devices=1
      record pytorch_2devices experiments.benchmark --num_devices=2 ;;
    matrix)
      record matrix experiments.benchmark --matrix --nopytorch ;;
    algorithms)
      for a in $ALGORITHMS; do
        record "algorithm_$a" experiments.benchmark --algorithm="$a" \
          --local_epochs=1 --rounds=5 --nopytorch --nolimit --nopeak
      done ;;
    zoo)
      record zoo experiments.zoo_report ;;
    *) echo "unknown part: $part" >&2; exit 2 ;;
  esac
done
