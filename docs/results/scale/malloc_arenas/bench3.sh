#!/bin/bash
cd /work/main
for a in 4 16 4; do
  MALLOC_ARENA_MAX=$a .venv/bin/python -m experiments.benchmark > /work/b40/c_arena${a}_$RANDOM.txt 2>&1
done
for a in 4; do for dev in 1 2; do
  wd=/work/m40/wd_a${a}_${dev}; rm -rf $wd
  MALLOC_ARENA_MAX=$a /usr/bin/time -v .venv/bin/python -m experiments.run --rounds=2 --num_devices=$dev --workdir=$wd > /work/m40/a${a}_${dev}.log 2>&1
  echo "arena$a dev=$dev $(grep 'Maximum resident' /work/m40/a${a}_${dev}.log) $(grep 'Elapsed' /work/m40/a${a}_${dev}.log)" >> /work/m40/summary.txt
done; done
