#!/bin/bash
# default benchmark, before (5a773e2, /work/pre40) and after (HEAD, /work/main), alternating
for rep in 1 2; do for side in before after; do
  if [ $side = before ]; then src=/work/pre40; else src=/work/main; fi
  ( cd $src && /work/main/.venv/bin/python -m experiments.benchmark ) > /work/b40/${side}_${rep}.txt 2>&1
  echo "$side $rep $(grep -E 'round/limit ratio|round/pytorch ratio|median round|s/round|seconds per round' /work/b40/${side}_${rep}.txt | tr '\n' ' ')" >> /work/b40/summary.txt
done; done
