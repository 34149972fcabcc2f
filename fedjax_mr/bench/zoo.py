"""The cost of the zoo's models and datasets on this machine: the time of
a model's local epoch, and the host memory of loading a dataset."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import jax
import numpy as np
import optax

from fedjax_mr.data import client_data
from fedjax_mr.data import datasets
from fedjax_mr.data import partition
from fedjax_mr.models import model as model_lib
from fedjax_mr.training import client

# (model, input shape, classes): the papers' dataset for each model.
MODELS = {
  'cnn_mnist': ((28, 28, 1), 10),
  'cnn_fedavg': ((28, 28, 1), 10),
  'cnn_femnist': ((28, 28, 1), 62),
  'cnn_cifar': ((32, 32, 3), 10),
  'resnet20': ((32, 32, 3), 10),
  'resnet18': ((32, 32, 3), 10),
  'vgg16': ((32, 32, 3), 10),
  'char_lstm': ((80,), 80),
}
# Training examples of the tfds datasets, for mock data at full size.
TFDS_TRAIN = {
  'fashion_mnist': 60_000,
  'mnist': 60_000,
  'cifar10': 50_000,
  'cifar100': 50_000,
  'emnist': 697_932,
  'svhn_cropped': 73_257,
}
# Arrays the file-based loaders build: (examples, bytes per example).
COMPUTED = {
  'femnist': (805_263, 28 * 28 * 1),  # LEAF, all writers, uint8 pixels
  'shakespeare': (4_226_158, 80),  # LEAF, uint8 character ids, 80 each
  'cinic10': (270_000, 32 * 32 * 3),  # train + valid + test, uint8
}
# One local epoch: 600 samples in steps of this batch (12 steps).
EPOCH_EXAMPLES = 600
EPOCH_BATCH = 50


def _status_mib(field: str) -> float:
  """A memory figure of this process from /proc/self/status (Linux)."""
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(field + ':'):
        return int(line.split()[1]) / 1024
  return 0.0


def rss_mib() -> float:
  """This process's resident memory (MiB)."""
  return _status_mib('VmRSS')


def peak_rss_mib() -> float:
  """This process's peak resident memory (MiB)."""
  # VmHWM, not getrusage's ru_maxrss: the latter survives exec and would
  # report the parent's peak.
  return _status_mib('VmHWM')


def time_model(name: str, repeats: int) -> dict[str, Any]:
  """One local epoch of zoo model `name` (a key of `MODELS`, at its
  papers' input shape) on random examples: plain SGD with momentum, the
  papers' client update, jitted.

  Returns:
    {'params': its parameter count, 'compile_s': the first call's seconds
    beyond an epoch, 'epoch_s': the median of `repeats` epochs}.
  """
  shape, classes = MODELS[name]
  model = model_lib.get(name, classes, shape)
  rng = np.random.default_rng(0)
  n = EPOCH_EXAMPLES
  if len(shape) == 1:
    x = rng.integers(0, classes, (n, *shape), dtype=np.int32)
  else:
    x = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
  y = rng.integers(0, classes, n).astype(np.int32)
  data = client_data.from_partition(x, y, [np.arange(n)], 1 / 255, 0.0)
  update = jax.jit(
    client.make_client_update(
      model,
      optax.sgd(0.01, momentum=0.9),
      local_epochs=1,
      batch_size=EPOCH_BATCH,
    )
  )
  variables = model.init(jax.random.key(0))
  count = sum(x.size for x in jax.tree.leaves(variables['params']))
  key = jax.random.key(1)
  cid = jax.numpy.int32(0)
  t0 = time.perf_counter()
  jax.block_until_ready(update(variables, data, cid, key))
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(update(variables, data, cid, key))
    times.append(time.perf_counter() - t0)
  epoch = statistics.median(times)
  return {
    'params': count,
    'compile_s': max(first - epoch, 0.0),
    'epoch_s': epoch,
  }


def dataset_memory(name: str) -> tuple[float, float, str]:
  """The host memory of loading tfds dataset `name` (a key of
  `TFDS_TRAIN`) and putting its training and test examples on the device;
  call it in a fresh process.

  Returns:
    `(peak MiB, arrays MiB, how)`: the process's peak resident memory
    beyond what it held after starting JAX; the size of the loaded
    examples; 'real' (the stored Fashion-MNIST) or 'mock'
    (`tfds.testing.mock_data` at the real number of training examples).
  """
  # Heavy (TensorFlow's parts): imported by the measuring process alone,
  # before its baseline.
  import tensorflow_datasets as tfds

  jax.numpy.zeros(1).block_until_ready()
  base = rss_mib()
  real = name == 'fashion_mnist' and os.path.isdir(
    datasets.DEFAULT_FASHION_MNIST_DIR
  )
  if real:
    ds = datasets.load(name)
  else:
    with tfds.testing.mock_data(num_examples=TFDS_TRAIN[name]):
      ds = datasets.load(name)
  parts = partition.iid(len(ds.y_train), 100, 0)
  train = client_data.from_partition(
    ds.x_train, ds.y_train, parts, ds.scale, ds.shift
  )
  test = client_data.eval_data(ds.x_test, ds.y_test, 1000, ds.scale, ds.shift)
  jax.block_until_ready((train.x, test))
  arrays = (ds.x_train.nbytes + ds.x_test.nbytes) / 2**20
  del ds
  return peak_rss_mib() - base, arrays, 'real' if real else 'mock'


def model_row(name: str, figures: dict[str, Any]) -> str:
  """Model `name`'s row of the models' table (`time_model`'s figures)."""
  shape = 'x'.join(map(str, MODELS[name][0]))
  return (
    f'| {name} | {shape} | {figures["params"]:,} | '
    f'{figures["compile_s"]:.1f} | {figures["epoch_s"]:.2f} |'
  )


def computed_row(name: str) -> str:
  """The datasets' table row of a file-loaded dataset (`COMPUTED`)."""
  n, per = COMPUTED[name]
  return (
    f'| {name} | {n:,} | {n * per / 2**20:.0f} | - | computed '
    '(file loader, not run) |'
  )
