r"""Cost of every model and dataset of the zoo on this machine.

  python -m experiments.zoo_report                      # both tables
  python -m experiments.zoo_report --datasets=          # models only
  python -m experiments.zoo_report --models=cnn_mnist,resnet20 --datasets=

Models: parameter count, compile time and the median time of one local
epoch of 600 samples (12 steps of batch 50, plain SGD with momentum, the
papers' client update) for each model at the input shape of the papers'
dataset for it. Datasets: peak host memory of loading the dataset and
putting its training and test examples on the device, each measured in a
fresh subprocess (the process's peak resident memory minus its resident
memory after the imports). Datasets that cannot be downloaded here are measured
with `tfds.testing.mock_data` at their real number of training examples
(the mock gives the test split as many examples too, so those rows
slightly overstate); LEAF and CINIC-10 rows are the size of the arrays the
loaders build, computed, not measured.
"""

from __future__ import annotations

# First: Ctrl-C while the modules below import ends in one line (cli).
from . import cli  # isort: split

import os
import statistics
import subprocess
import sys
import time

from absl import flags

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

_MODELS = flags.DEFINE_list('models', list(MODELS), 'Models to time.')
_DATASETS = flags.DEFINE_list(
  'datasets', list(TFDS_TRAIN) + list(COMPUTED), 'Datasets to measure.'
)
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed epochs per model.')
_MEMORY_OF = flags.DEFINE_string(
  'memory_of', '', 'Internal: measure one dataset in this process.'
)


def _status_mib(field: str) -> float:
  """A memory figure of this process from /proc/self/status (Linux)."""
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(field + ':'):
        return int(line.split()[1]) / 1024
  return 0.0


def _rss_mib() -> float:
  return _status_mib('VmRSS')


def _peak_rss_mib() -> float:
  # VmHWM, not getrusage's ru_maxrss: the latter survives exec and would
  # report the parent's peak.
  return _status_mib('VmHWM')


def _time_model(name: str, repeats: int) -> dict:
  import jax
  import numpy as np
  import optax

  from fedjax_mr.data import client_data
  from fedjax_mr.models import model as model_lib
  from fedjax_mr.training import client

  shape, classes = MODELS[name]
  model = model_lib.get(name, classes, shape)
  rng = np.random.default_rng(0)
  n = 600
  if len(shape) == 1:
    x = rng.integers(0, classes, (n, *shape), dtype=np.int32)
  else:
    x = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
  y = rng.integers(0, classes, n).astype(np.int32)
  data = client_data.from_partition(x, y, [np.arange(n)], 1 / 255, 0.0)
  update = jax.jit(
    client.make_client_update(
      model, optax.sgd(0.01, momentum=0.9), local_epochs=1, batch_size=50
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


def _measure_dataset(name: str) -> None:
  """In a fresh process: prints the peak RSS increase of loading `name`."""
  import jax
  import tensorflow_datasets as tfds

  from fedjax_mr.data import client_data
  from fedjax_mr.data import datasets
  from fedjax_mr.data import partition

  jax.numpy.zeros(1).block_until_ready()
  base = _rss_mib()
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
  print(
    f'{_peak_rss_mib() - base:.0f} {arrays:.0f} {"real" if real else "mock"}'
  )


def main(argv) -> None:
  cli.no_arguments(argv)
  if _MEMORY_OF.value:
    _measure_dataset(_MEMORY_OF.value)
    return
  for name in _MODELS.value:
    if name not in MODELS:
      cli.fail(f'--models: unknown {name!r}; one of {list(MODELS)}')
  for name in _DATASETS.value:
    if name not in TFDS_TRAIN and name not in COMPUTED:
      cli.fail(
        f'--datasets: unknown {name!r}; one of '
        f'{list(TFDS_TRAIN) + list(COMPUTED)}'
      )
  if _REPEATS.value < 1:
    cli.fail('--repeats must be >= 1')
  if _MODELS.value:
    import jax

    print(
      f'one local epoch of 600 samples (B=50, 12 steps) on '
      f'{jax.devices()[0].device_kind}, median of {_REPEATS.value}'
    )
    print('| model | input | parameters | compile (s) | epoch (s) |')
    print('|---|---|---|---|---|')
    for name in _MODELS.value:
      r = _time_model(name, _REPEATS.value)
      shape = 'x'.join(map(str, MODELS[name][0]))
      print(
        f'| {name} | {shape} | {r["params"]:,} | {r["compile_s"]:.1f} | '
        f'{r["epoch_s"]:.2f} |',
        flush=True,
      )
  if _DATASETS.value:
    print()
    print(
      '| dataset | examples (train) | arrays (MiB) | peak host (MiB) | how |'
    )
    print('|---|---|---|---|---|')
    for name in _DATASETS.value:
      if name in COMPUTED:
        n, per = COMPUTED[name]
        print(
          f'| {name} | {n:,} | {n * per / 2**20:.0f} | - | computed '
          '(file loader, not run) |'
        )
        continue
      proc = subprocess.run(
        [sys.executable, '-m', __spec__.name, f'--memory_of={name}'],
        capture_output=True,
        text=True,
        env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'},
      )
      if proc.returncode:
        print(f'| {name} | failed: {proc.stderr.strip().splitlines()[-1]} |')
        continue
      peak, arrays, how = proc.stdout.split()[:3]
      print(
        f'| {name} | {TFDS_TRAIN[name]:,} | {arrays} | {peak} | {how} |',
        flush=True,
      )


def entry() -> None:
  """The console script `fedjax-mr-zoo-report`."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  cli.run(main)


if __name__ == '__main__':
  entry()
