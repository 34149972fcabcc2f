"""Issue 73: the deployed round against the simulated one with the training
set kept on the host (data_placement=host: a node trains on its one-client
view, the simulation on the round's K-client gather), Fashion-MNIST,
cnn_mnist, 200 clients, K = 5, at a program's XLA flags, two rounds,
replies interleaved, the nodes in this process (tests/deploy/
test_server.py's `LocalWithState`):

  XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
    .venv/bin/python docs/results/deploy/host_placement.py \\
    > docs/results/deploy/host_placement.txt

Prints, per (algorithm, devices, chunk), the server-state leaves and the
metrics that differ (none expected).
"""

import os
import platform
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', '..', '..'))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from fedjax_mr.deploy import adapter  # noqa: E402
from fedjax_mr.deploy import server  # noqa: E402
from fedjax_mr.pipeline import config as config_lib  # noqa: E402
from fedjax_mr.pipeline import experiment as experiment_lib  # noqa: E402
from tests.deploy import test_server as t  # noqa: E402

CASES = [('fedavg', 2, 2), ('fedmr', 1, 3), ('scaffold', 2, 2)]


def experiment(algorithm, chunk, devices):
  return adapter.setup(
    config_lib.ExperimentConfig.from_flat(
      algorithm=algorithm,
      dataset='fashion_mnist',
      model='cnn_mnist',
      num_clients=200,
      clients_per_round=5,
      local_epochs=1,
      client_chunk=chunk,
      num_devices=devices,
      seed=5,
      data_placement='host',
      partition='iid',
    )
  )


def differences(algorithm, devices, chunk, folder):
  ex = experiment(algorithm, chunk, devices)
  local = t.LocalWithState(ex, folder, 'interleaved')
  deployed = server.make_round(ex, chunk, local, t.NODES)
  simulated = experiment_lib._compile_round(ex, chunk)
  state = ex.state
  want = jax.tree.map(lambda x: np.array(x, copy=True), state)  # donated
  differ = []
  for r in range(2):
    state, metrics = deployed(state, ex.data, ex.key)
    want, want_metrics = simulated(want, ex.data, ex.key)
    leaves = jax.tree_util.tree_leaves_with_path(state.server)
    for (path, x), y in zip(leaves, jax.tree.leaves(want.server)):
      if not np.array_equal(np.asarray(x), np.asarray(y)):
        differ.append(f'round {r + 1} {jax.tree_util.keystr(path)}')
    for name in sorted(metrics):
      if not np.array_equal(metrics[name], want_metrics[name]):
        differ.append(f'round {r + 1} {name}')
  return type(ex.data).__name__, differ


def cpu():
  with open('/proc/cpuinfo') as f:
    for line in f:
      if line.startswith('model name'):
        return line.split(':', 1)[1].strip()
  return platform.machine()


def main():
  commit = subprocess.run(
    ['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True
  ).stdout.strip()
  print(f'machine: {cpu()}, {os.cpu_count()} CPUs; commit {commit}')
  folder = tempfile.mkdtemp()
  for algorithm, devices, chunk in CASES:
    kind, differ = differences(
      algorithm, devices, chunk, f'{folder}/{algorithm}'
    )
    print(
      f'{algorithm}: {devices} device(s), client_chunk {chunk}, {kind}: '
      f'differ {differ}'
    )
  shutil.rmtree(folder)


if __name__ == '__main__':
  main()
