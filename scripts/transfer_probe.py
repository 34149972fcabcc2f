"""Why FedStitch's transfer-setting probe reads a network's trunk.

For each model of a pool pre-trained on Fashion-MNIST classes 0-4
(`experiments.pretrain_zoo --classes=0-4 --workdir=runs/pool_0-4`), the
test accuracy on classes 5-9 of three probes, each on two readings of the
model: its output (the five logits of the pool's own classes) and the
input of its end block (`--cuts=every_unit`, the features it classifies
from):

* a 5-NN probe on 2,000 public examples of classes 5-9 (what
  `experiments.stitch --eval=knn` fits);
* a ridge-regression classifier (standardised features, λ = 1e-3 per
  example, closed form) on the same 2,000 examples;
* the same on every client's examples (the non-public ones), a classifier
  that clients could fit without back-propagation by uploading FᵀF and FᵀY.

  .venv/bin/python scripts/transfer_probe.py [pool folder] > probe.json
"""

import json
import sys

import numpy as np

from fedjax_mr.data import datasets
from fedjax_mr.stitch import network
from fedjax_mr.stitch import pool as pool_lib


def ridge(f_train, y_train, f_test, num_classes, lam=1e-3):
  mu, sd = f_train.mean(0), f_train.std(0) + 1e-6
  a = np.c_[(f_train - mu) / sd, np.ones(len(f_train))]
  t = np.c_[(f_test - mu) / sd, np.ones(len(f_test))]
  target = np.eye(num_classes)[y_train]
  eye = lam * len(a) * np.eye(a.shape[1])
  return (t @ np.linalg.solve(a.T @ a + eye, a.T @ target)).argmax(1)


def main(folder: str) -> None:
  ds = datasets.load('fashion_mnist')
  ds = datasets.select_classes(ds, list(range(5, 10)))
  models = pool_lib.load(folder)
  chains = pool_lib.chains(models, 'every_unit')
  public = np.asarray(pool_lib.public_indices(folder)['indices'])
  public = public[ds.y_train[public] >= 0]
  ref = public[:2000]
  clients = np.setdiff1d(np.flatnonzero(ds.y_train >= 0), public)
  kw = dict(scale=ds.scale, shift=ds.shift)
  out = {}
  for m, chain in zip(models, chains):
    row = {}
    for name, blocks in (('output', chain), ('trunk', chain[:-1])):
      net = network.Network(tuple(blocks), (None,) * len(blocks))
      f_ref = network.outputs(net, ds.x_train[ref], **kw)
      f_test = network.outputs(net, ds.x_test, **kw)
      f_all = network.outputs(net, ds.x_train[clients], **kw)
      y_ref, y_all = ds.y_train[ref], ds.y_train[clients]

      def acc(pred):
        return float(np.mean(pred == ds.y_test))

      row[name] = {
        'dim': int(f_test.shape[1]),
        'knn': acc(network.knn_predict(f_ref, y_ref, f_test)),
        'ridge_public': acc(ridge(f_ref, y_ref, f_test, ds.num_classes)),
        'ridge_clients': acc(ridge(f_all, y_all, f_test, ds.num_classes)),
      }
    out[m.id] = row
    print(m.id, json.dumps(row), file=sys.stderr, flush=True)
  print(json.dumps(out, indent=1))


if __name__ == '__main__':
  main(sys.argv[1] if len(sys.argv) > 1 else 'runs/pool_0-4')
