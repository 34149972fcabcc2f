#!/bin/bash
# peak RSS of the default run, 2 rounds, at HEAD (cap on several host devices only), 1 and 2 devices, alternating
cd /work/main
for rep in 1 2 3; do for dev in 1 2; do
  wd=/work/m40/wd_new_${dev}_${rep}; rm -rf $wd
  /usr/bin/time -v .venv/bin/python -m experiments.run --rounds=2 --num_devices=$dev --workdir=$wd > /work/m40/new_${dev}_${rep}.log 2>&1
  echo "new dev=$dev rep=$rep $(grep 'Maximum resident' /work/m40/new_${dev}_${rep}.log) $(grep 'Elapsed' /work/m40/new_${dev}_${rep}.log) load $(cut -d' ' -f1 /proc/loadavg)" >> /work/m40/summary2.txt
done; done
