#!/bin/bash
# peak RSS of the default run, 2 rounds, before (99ab462) and after (mallopt), 1 and 2 devices, alternating
cd /work/m40
for rep in 1 2; do
for dev in 1 2; do
for side in before after; do
  if [ $side = before ]; then src=/work/before40; else src=/work/main; fi
  wd=/work/m40/wd_${side}_${dev}_${rep}; rm -rf $wd
  ( cd $src && /usr/bin/time -v /work/main/.venv/bin/python -m experiments.run --rounds=2 --num_devices=$dev --workdir=$wd ) > /work/m40/${side}_${dev}_${rep}.log 2>&1
  echo "$side dev=$dev rep=$rep $(grep 'Maximum resident' /work/m40/${side}_${dev}_${rep}.log) $(grep 'Elapsed' /work/m40/${side}_${dev}_${rep}.log)" >> /work/m40/summary.txt
done; done; done
