#!/bin/bash
# The six runs of measure.py recorded here (BUILD.md "Scale: the training
# set on the host"), alternating with and without prefetching; run from
# the repository root.
out=docs/results/scale/prefetch
work=${TMPDIR:-/tmp}/prefetch_runs
i=0
for spec in "host 1" "host 0" "memmap 1" "host 1" "host 0" "memmap 0"; do
  set -- $spec
  i=$((i+1))
  name=run${i}_$1_prefetch$2
  rm -rf "$work/$name"
  { echo "# $(date -u +%FT%TZ) $(git rev-parse --short HEAD) load: $(cut -d' ' -f1-3 /proc/loadavg)";
    echo "# PYTHONPATH=. python docs/results/scale/prefetch/measure.py $1 $2 $work/$name";
    PYTHONPATH=$PWD python docs/results/scale/prefetch/measure.py $1 $2 "$work/$name" 2>&1 \
      | grep -v "^WARNING\|^I0000\|^W0000"; } > $out/$name.txt
done
