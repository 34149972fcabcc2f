#!/bin/bash
# GPU scale figures (issue 40): HEAD ("after", the working tree) and
# 5a773e2 ("before" streaming, .gpu/before), FedAvg, Fashion-MNIST N=60000.
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3
PY=${PY:-python3}
ROOT=$PWD
D=$ROOT/.gpu/fmnist
START=$(date +%s)
LIMIT=${LIMIT:-530}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt 2>&1
$PY -c 'import jax, flax, optax, numpy; print(jax.__version__, flax.__version__, optax.__version__, numpy.__version__, jax.devices())' >> $OUT/gpu.txt 2>&1
cat $OUT/gpu.txt
B="--num_clients=60000 --local_epochs=1 --batch_size=1 --nolimit --nopytorch --rounds=${ROUNDS:-3} --num_devices=1 --data_dir=$D"
one() { # tag dir model K [extra]
  local now=$(date +%s)
  if (( now - START > LIMIT )); then echo "== $1 skipped (time)" >> $OUT/summary.txt; return; fi
  echo "######## $1" >> $OUT/all.log
  ( cd $2 && timeout ${JOBT:-150} $PY -m experiments.benchmark $B --model=$3 --clients_per_round=$4 $5 ) > $OUT/cur.log 2>&1
  local rc=$?
  cat $OUT/cur.log >> $OUT/all.log; 
  echo "== $1 rc=$rc $(( $(date +%s) - now ))s" >> $OUT/summary.txt
  grep -E '^\[|peak host' $OUT/cur.log >> $OUT/summary.txt
  tail -n 3 $OUT/cur.log | grep -iE 'error|Trace' >> $OUT/summary.txt
  rm -f $OUT/cur.log
}
A=$ROOT; O=$ROOT/.gpu/before
JOBS=${JOBS:-"a_cnn_100:$A:cnn_mnist:100 a_cnn_1000:$A:cnn_mnist:1000 a_cnn_10000:$A:cnn_mnist:10000 b_cnn_100:$O:cnn_mnist:100 b_cnn_1000:$O:cnn_mnist:1000 b_cnn_10000:$O:cnn_mnist:10000 a_res_100:$A:resnet20:100 a_res_1000:$A:resnet20:1000 a_res_10000:$A:resnet20:10000 b_res_100:$O:resnet20:100 b_res_1000:$O:resnet20:1000 b_res_10000:$O:resnet20:10000 a_cnn_10000_c1000:$A:cnn_mnist:10000:--client_chunk=1000 a_res_10000_c1000:$A:resnet20:10000:--client_chunk=1000"}
for j in $JOBS; do
  IFS=: read tag dir model k extra <<< "$j"
  one $tag $dir $model $k "$extra"
done
cat $OUT/summary.txt
