#!/usr/bin/env bash
# RSS sampled every 10 ms per phase (rss_phases.py wraps experiments.run),
# the 10^6-client SCAFFOLD before (2a16762) and after the fix (HEAD).
set -u
for where in pre:/work/wt_pre main:/work/main; do
  name=${where%%:*}; dir=${where#*:}
  rm -rf /tmp/rss_$name
  (cd "$dir" && MALLOC_ARENA_MAX=2 PYTHONPATH="$dir" /work/main/.venv/bin/python /work/rss/rss_phases.py \
    --dataset=synthetic --model=logistic --algorithm=scaffold --num_clients=1000000 \
    --clients_per_round=10000 --rounds=3 --workdir=/tmp/rss_$name) > /work/rss/$name.txt 2>&1
  echo "$name rc=$? commit $(git -C $dir rev-parse --short HEAD)" >> /work/rss/$name.txt
done
