#!/bin/bash
cd /work/main
for rep in 1 2; do for a in 16 2; do
  MALLOC_ARENA_MAX=$a .venv/bin/python -m experiments.benchmark --num_devices=2 > /work/b40/d2_arena${a}_${rep}.txt 2>&1
done; done
