#!/bin/bash
cd /work/main
for rep in 1 2; do
  MALLOC_ARENA_MAX=16 .venv/bin/python -m experiments.benchmark > /work/b40/arena16_${rep}.txt 2>&1
  .venv/bin/python -m experiments.benchmark > /work/b40/arena2_${rep}.txt 2>&1
  ( cd /work/pre40 && /work/main/.venv/bin/python -m experiments.benchmark ) > /work/b40/before_${rep}b.txt 2>&1
done
