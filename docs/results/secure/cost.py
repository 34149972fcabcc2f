"""Issue 75's costs of secure aggregation, measured in one process:

1. A deployed round of the README's main job (Fashion-MNIST, Dir(0.1),
   100 clients, 10 a round, cnn_mnist, E 5, B 50; FedAvg), over 3 nodes
   served in this process (`node.serve` / `secure_node.serve`, each
   stage's requests packed per node as Flower carries them): messages
   (requests and replies), their bytes (arrays' serialized bytes, and the
   bytes and strings of config records), and seconds, plain against
   secure (SecAgg, every other client a neighbour; SecAgg+ with 4).
   Medians of 3 rounds after one (compiling) round.
2. A client's masking (`secagg.mask_input`: the self mask and one
   pairwise mask per neighbour) of an upload of cnn_mnist's and
   resnet20's sizes, with 9 and 4 neighbours; medians of 5.
3. The server's memory with K (`tracemalloc` peak of the server's side:
   the ciphertexts it forwards, the running sum, the shares and the
   unmasking), for an upload of 100,000 values, SecAgg (K <= 100) and
   SecAgg+ of degree 8.
4. The encoding's error in one round of the main job: the global model
   after round 1 with the encoding against the float round on this
   machine's 2 devices, and the float round on 1 device against it (the
   same maths, sums in another order): relative L2 distance of the
   models.

  .venv/bin/python docs/results/secure/cost.py > docs/results/secure/cost.txt
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', '..', '..'))
# Two host devices, as experiments.run makes on a 2-core machine (part 4).
os.environ['XLA_FLAGS'] = (
  os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=2'
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flwr.app import ArrayRecord  # noqa: E402
from flwr.app import ConfigRecord  # noqa: E402

from fedjax_mr.deploy import adapter  # noqa: E402
from fedjax_mr.deploy import node  # noqa: E402
from fedjax_mr.deploy import secure_node  # noqa: E402
from fedjax_mr.deploy import secure_round  # noqa: E402
from fedjax_mr.deploy import server  # noqa: E402
from fedjax_mr.models import model as model_lib  # noqa: E402
from fedjax_mr.pipeline import config as config_lib  # noqa: E402
from fedjax_mr.privacy import secagg  # noqa: E402

NODES = 3


def _record_bytes(content):
  total = 0
  for record in content.values():
    if isinstance(record, ArrayRecord):
      total += sum(len(a.data) for a in record.values())
    elif isinstance(record, ConfigRecord):
      for v in record.values():
        if isinstance(v, (bytes, str)):
          total += len(v)
        elif isinstance(v, list):
          total += 8 * len(v)
        else:
          total += 8
  return total


class Counting:
  """The nodes in this process; counts messages and bytes both ways."""

  def __init__(self, experiment, folder):
    self.experiment, self.folder = experiment, folder
    self.secure = experiment.config.privacy.secure.enabled
    self.reset()

  def reset(self):
    self.messages = self.bytes = 0

  def exchange(self, requests, timeout):
    by_node = {}
    for r in requests:
      by_node.setdefault(r.node, {})[r.position] = r.content
    serve = secure_node.serve if self.secure else node.serve
    replies = {}
    for n, parts in by_node.items():
      packed = node.pack(parts, 'x' * 1500)  # the run's config rides along
      served = serve(self.experiment, packed, n, NODES, f'{self.folder}/{n}')
      self.messages += 2
      self.bytes += _record_bytes(packed) + _record_bytes(served)
      replies.update(node.unpack(served))
    for r in requests:
      yield r.position, replies[r.position]


def _experiment(**flags):
  values = dict(
    dataset='fashion_mnist',
    model='cnn_mnist',
    num_clients=100,
    clients_per_round=10,
    partition='dirichlet',
    alpha=0.1,
    local_epochs=5,
    batch_size=50,
    lr=0.01,
    momentum=0.9,
    seed=0,
    num_devices=1,
    client_chunk=1,
  )
  values.update(flags)
  return adapter.setup(config_lib.ExperimentConfig.from_flat(**values))


def round_costs(folder):
  print('## 1. a deployed round of the main job (FedAvg), 3 nodes in process')
  cases = [
    ('plain', {}),
    ('SecAgg', {'secure_aggregation': True}),
    ('SecAgg+ (4)', {'secure_aggregation': True, 'secagg_neighbours': 4}),
  ]
  base = None
  for name, flags in cases:
    experiment = _experiment(**flags)
    transport = Counting(experiment, f'{folder}/{len(name)}')
    collect = None
    if flags:
      collect = secure_round.make_collect(experiment, transport, log=print)
    step = server.make_round(experiment, 1, transport, NODES, collect=collect)
    state = experiment.state
    seconds, messages, sizes = [], [], []
    for r in range(4):
      transport.reset()
      start = time.perf_counter()
      state, metrics = step(state, experiment.data, experiment.key)
      jax.block_until_ready(state)
      if r:
        seconds.append(time.perf_counter() - start)
        messages.append(transport.messages)
        sizes.append(transport.bytes)
    row = (
      statistics.median(messages),
      statistics.median(sizes),
      statistics.median(seconds),
    )
    base = base or row
    print(
      f'{name:12s} messages {row[0]:4.0f} ({row[0] / base[0]:.1f}x)  '
      f'bytes {row[1] / 1e6:7.2f} MB ({row[1] / base[1]:.2f}x)  '
      f'seconds {row[2]:6.2f} ({row[2] / base[2]:.2f}x)'
    )


def _size(name):
  model = model_lib.get(
    name, 10, (28, 28, 1) if name == 'cnn_mnist' else (32, 32, 3)
  )
  variables = model.init(jax.random.key(0))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(variables))


def mask_times():
  print()
  print("## 2. a client's masking of its upload (median of 5)")
  ctx = b'cost|0|' + bytes(16)
  for name in ('cnn_mnist', 'resnet20'):
    n = _size(name) + 3  # the model, its weight, its loss and flags
    values = np.zeros(n, np.uint32)
    for d in (9, 4):
      peers = {
        v: secagg.public_keys(secagg.new_seed())[1] for v in range(1, d + 1)
      }
      seed = secagg.new_seed()
      times = []
      for _ in range(5):
        start = time.perf_counter()
        secagg.mask_input(seed, 0, peers, values, 32, ctx)
        times.append(time.perf_counter() - start)
      t = statistics.median(times)
      print(
        f'{name:10s} {n:>9,d} values, {d} neighbours: {t * 1e3:7.1f} ms '
        f'({n * 4 * (d + 1) / t / 1e9:.2f} GB/s of key stream)'
      )


def _server_peak(k, degree, n=100_000):
  """Peak traced bytes of the server's side of one attempt (the clients'
  work done first, untraced)."""
  ctx = b'cost|0|' + bytes(16)
  ids = list(range(k))
  seeds = {u: secagg.new_seed() for u in ids}
  pks = {u: secagg.public_keys(seeds[u]) for u in ids}
  graph = secagg.neighbours(ids, degree, b'g')
  t = secagg.threshold(len(graph[0]), 2 / 3)
  cts = {
    u: secagg.share_keys(seeds[u], u, {v: pks[v] for v in graph[u]}, t, ctx)
    for u in ids
  }
  alive = ids[1:]  # client 0 drops before its masked input
  rng = np.random.default_rng(0)
  masked = {
    u: secagg.mask_input(
      seeds[u],
      u,
      {v: pks[v][1] for v in graph[u]},
      rng.integers(0, 2**20, n).astype(np.uint32),
      32,
      ctx,
    )
    for u in alive
  }
  revealed = {}
  for h in alive:
    senders = {v: (pks[v][0], cts[v][h]) for v in graph[h]}
    senders[h] = (pks[h][0], cts[h][h])
    revealed[h] = secagg.reveal(
      seeds[h],
      h,
      senders,
      [v for v in graph[h] if v != 0],
      [v for v in graph[h] if v == 0],
      ctx,
    )
  tracemalloc.start()
  # What the server holds: the keys and ciphertexts it forwards, the
  # running sum (the masked inputs arrive one at a time: streamed from
  # the dict, never copied), the revealed shares, the unmasking.
  held_keys = {u: b''.join(pks[u]) for u in ids}
  held_cts = {u: {v: bytes(c) for v, c in cts[u].items()} for u in ids}
  total = np.zeros(n, np.uint32)
  for u in alive:
    total += masked[u]
  held = {h: dict(r) for h, r in revealed.items()}
  secagg.unmask(
    total, alive, [0], graph, {u: pks[u][1] for u in ids}, held, t, 32, ctx
  )
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  del held_keys, held_cts
  return peak


def server_memory():
  print()
  print("## 3. the server's memory with K (an upload of 100,000 values)")
  for k, degree in ((10, 0), (50, 0), (100, 0), (100, 8), (300, 8), (1000, 8)):
    peak = _server_peak(k, degree)
    kind = 'SecAgg' if degree == 0 else f'SecAgg+ ({degree})'
    print(f'K = {k:5d} {kind:12s} peak {peak / 2**20:7.1f} MiB')


def encoding_error():
  print()
  print('## 4. the global model after round 1 (main job, FedAvg)')
  from fedjax_mr.pipeline import experiment as experiment_lib

  def after_one(**flags):
    e = _experiment(**flags)
    chunk = e.config.devices.client_chunk
    step = experiment_lib._compile_round(e, chunk)
    state, _ = step(e.state, e.data, e.key)
    leaves = jax.tree.leaves(jax.device_get(state.server.params))
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in leaves])

  base = after_one(num_devices=2)
  for name, flags in (
    ('secure, 2 devices', {'num_devices': 2, 'secure_aggregation': True}),
    ('float, 1 device', {}),
  ):
    other = after_one(**flags)
    rel = np.linalg.norm(other - base) / np.linalg.norm(base)
    print(
      f'{name:18s} vs float on 2 devices: relative L2 {rel:.2e}, '
      f'largest difference {np.abs(other - base).max():.2e}'
    )


def main():
  cpu = subprocess.run(['lscpu'], capture_output=True, text=True).stdout
  names = [
    line.split(':', 1)[1].strip()
    for line in cpu.splitlines()
    if line.startswith('Model name')
  ]
  commit = subprocess.run(
    ['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True
  ).stdout.strip()
  name = names[0] if names else '?'
  print(f'machine: {name}, {os.cpu_count()} CPUs; commit {commit}')
  with tempfile.TemporaryDirectory() as folder:
    round_costs(folder)
  mask_times()
  server_memory()
  encoding_error()


if __name__ == '__main__':
  main()
