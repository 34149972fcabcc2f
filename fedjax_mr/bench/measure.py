r"""Benchmarks a federated round against the hardware limit: `measure`.

For one setting it measures: compile time; steady-state seconds per round
(median over `rounds` after a warm-up, `block_until_ready`); the *limit* —
centralised training of the same model on the same number of sample-steps
and batch size, as one jitted loop in this process with the same fast
layers; the ratio round/limit; samples/s; achieved GFLOP/s; the server-side
share of a round; the evaluation share (the model a run evaluates, and
for FedMR-type algorithms the K models it dispatches next, on the whole
test set as a training run evaluates them, once per `eval_every` rounds,
as a fraction of those rounds' time); peak memory; and, given a PyTorch
loop (`torch_loop`), the round time of a plain PyTorch FedAvg loop on the
same clients (same model, batches, epochs and step counts). Every timed
round is followed by the limit at exactly that round's number of steps
(with Dirichlet sizes every round runs a different number) and by the
PyTorch round, and with several device settings the rounds of each setting
alternate, so ratios and speed-ups compare runs made seconds apart. Then
the float32 and bfloat16 matmul peak of device 0 (large jitted products,
measured in the same process) and the first setting's fraction of the
float32 peak; the first setting's per-client overhead, `per-client
overhead: X ms/client (Y% of the round)`: what a round costs beyond its
limit, (round − limit) / K, and that as a share of the round (both the
median over the timed rounds, each round against the limit timed right
after it). The last lines are `evaluation share: X.X%`, `round/pytorch
ratio: X.XX` (with PyTorch) and `round/limit ratio: X.XX` for the first
setting.

`dataset=synthetic` (with `model=logistic`) benchmarks at scale:
Synthetic(α, β) (`fedjax_mr.data.synthetic`; seed 0), N clients generated
on demand with their own lognormal sizes (the size setting is `lognormal`;
`sizes` and `alpha` do not apply) and their held-out test set, as a
training run builds them. A round generates each batch's examples as its
local step asks for them, so its limit does too: the same number of steps
of batch B, each generating B fresh examples of one client (client 0,
positions following on from a random start) with `SyntheticData.batch`,
the round's generator. The limit thus pays the per-example cost of
generation (a normal draw per feature, the labelling model's product) and,
once, that client's parameters; it leaves out what the round pays per
client: the sampling of K of N, dispatch and the sum, drawing each
client's parameters (W_k, b_k, v_k: 672 normals, XLA hoists them out of
the step loop, so once per client), the per-epoch permutation (uniform
draws and an argsort over the largest client size) and each client's loop
and optimizer setup. That is the per-client overhead. There is no PyTorch
loop for generated clients.

`algorithm` times another algorithm of the registry (its hyper-parameters
`algorithm_options`) on the same clients, and FedAvg beside it on the
first device setting, round for round; the report then also says
`round/fedavg ratio: X.XX`, the median ratio of the two algorithms' time
per local step (equal to the ratio of round times when both train the same
clients; clustered sampling draws its own). The limit and the PyTorch loop
stay FedAvg's work on the algorithm's clients: what the algorithm's extra
computation costs shows in those ratios too.

For GPU checks: `random_data` times on random images of the dataset's
shape; `sizes=range` draws client sizes from
`min_client_size..max_client_size`; `client_chunks` times several
`client_chunk` settings round by round in one process; `limit_batch`
makes the limit the round's samples trained centrally in batches of that
size; `compute_dtype` and `matmul_precision` set the precision of both
sides; every setting's line ends with the SHA-256 of its final server
state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from typing import Any
from typing import Callable
from typing import NamedTuple
from typing import Protocol

import jax
import optax

from fedjax_mr.bench import limit as limit_lib
from fedjax_mr.bench import report as report_lib
from fedjax_mr.bench import runs as runs_lib
from fedjax_mr.bench import setting as setting_lib
from fedjax_mr.bench import timing
from fedjax_mr.core import errors
from fedjax_mr.data import client_data
from fedjax_mr.data import datasets
from fedjax_mr.data import partition
from fedjax_mr.models import model as model_lib
from fedjax_mr.pipeline import checks


class TorchLoop(Protocol):
  """A plain PyTorch FedAvg loop on the same clients."""

  def round(self, client_ids: list[int]) -> tuple[float, int]:
    """Trains the clients `client_ids`; returns (seconds, local steps)."""


# `torch_loop(setting, dataset, partition, num_params, device) -> (loop,
# line)`: the PyTorch loop on a stored dataset's partition, on device
# 'cpu' or 'cuda' (None: no such model), and the line that says what it is
# or why there is none; it checks the model has `num_params` parameters.
TorchLoopFactory = Callable[
  [setting_lib.Setting, Any, Any, int, str], tuple[TorchLoop | None, str]
]
NO_TORCH_LINE = 'PyTorch reference: not installed (pip install -e .[bench])'


def check(setting: setting_lib.Setting) -> None:
  """Raises `errors.UserError` naming the first bad field of `setting`
  (before any JAX work)."""
  setting_lib.check(setting, os.cpu_count() or 1)
  runs_lib.check(setting)


def measure(
  setting: setting_lib.Setting,
  *,
  torch_loop: TorchLoopFactory | None = None,
  log: Callable[[str], None] = lambda line: None,
) -> report_lib.Report:
  """Times `setting` (module docstring); `log` gets each line as it is
  made (backticked names are the setting's fields); `torch_loop` makes the
  PyTorch loop (None: not installed). Raises `errors.UserError` for a bad
  setting."""
  check(setting)
  runs_lib.initialize(
    host_devices=setting.host_devices,
    clients_per_round=setting.clients_per_round,
  )
  precision = setting.matmul_precision
  with (
    jax.default_matmul_precision(precision)
    if precision != 'default'
    else contextlib.nullcontext()
  ):
    return _measure(setting, torch_loop, log)


def _measure(setting, torch_loop, log) -> report_lib.Report:
  lines = []

  def say(line):
    lines.append(line)
    log(line)

  n_dev, platform = len(jax.devices()), jax.devices()[0].platform
  device_settings = setting_lib.device_settings(setting, n_dev)
  clients = _setup(setting, {s for s, _ in device_settings})
  say(report_lib.header_line(setting, n_dev, platform))
  if clients.stored is None:
    config = runs_lib.experiment_config(setting, setting.algorithm)
    say(
      report_lib.clients_line(
        clients.data['lognormal'],
        config.data.synthetic_alpha,
        config.data.synthetic_beta,
      )
    )
  results = []
  if setting.pytorch and clients.stored is None:
    say('PyTorch reference: none for generated clients (`dataset=synthetic`)')
  for sizes in setting_lib.size_kinds(setting):
    devs = [dev for s, dev in device_settings if s == sizes]
    if not devs:
      continue
    loop = None
    if setting.pytorch and clients.stored is not None:
      loop, line = _torch(setting, torch_loop, clients, sizes)
      if loop is not None or sizes == device_settings[0][0]:
        say(line)
    for r in _bench_sizes(setting, sizes, devs, clients, loop):
      results.append(r)
      say(report_lib.setting_line(r, setting))
  memory = report_lib.peak_memory_mib()
  peak = None
  if setting.peak:
    peak = (limit_lib.peak_gflops('float32'), limit_lib.peak_gflops('bfloat16'))
  for line in report_lib.summary_lines(setting, results, n_dev, memory, peak):
    say(line)
  return report_lib.Report(
    setting=setting,
    platform=platform,
    num_devices=n_dev,
    results=tuple(results),
    speedups=report_lib.speedups(results, n_dev),
    peak_host_mib=memory[0],
    peak_device_mib=memory[1],
    peak_gflops=peak,
    lines=tuple(lines),
  )


def _torch(setting, torch_loop, clients, sizes):
  """(the PyTorch loop or None, its line) on the clients of `sizes`."""
  if torch_loop is None:
    return None, NO_TORCH_LINE
  ds, parts = clients.stored
  num_params = sum(v.size for v in jax.tree.leaves(clients.variables['params']))
  device = 'cpu' if jax.devices()[0].platform == 'cpu' else 'cuda'
  return torch_loop(setting, ds, parts[sizes], num_params, device)


class _Clients(NamedTuple):
  """What every setting of a benchmark times with: the zoo model (`base`),
  its optimizer (`opt`) and initial `variables`, the clients of each size
  kind (`data`: {kind: ClientData or SyntheticData}), the `test_set`
  `(x, y, scale, shift)`, what the PyTorch loop reads (`stored`: `(dataset,
  {kind: partition})`, None for generated clients) and the timed
  `algorithms` ({name: `runs.algorithm`'s})."""

  base: model_lib.Model
  opt: optax.GradientTransformation
  variables: Any
  data: dict[str, Any]
  test_set: tuple
  stored: tuple | None
  algorithms: dict[str, tuple]


def _setup(setting, sizes) -> _Clients:
  """The model, clients and algorithms of `setting`, with the clients of
  each size kind of `sizes`."""
  if setting_lib.synthetic(setting):
    c = runs_lib.generated_clients(setting)
    data, stored = {'lognormal': c.data}, None
    test_set = (c.x_test, c.y_test, c.scale, c.shift)
    num_classes, input_shape = c.num_classes, c.input_shape
  else:
    ds, parts, data = _stored_clients(setting, sizes)
    test_set = (ds.x_test, ds.y_test, ds.scale, ds.shift)
    num_classes, input_shape = ds.num_classes, ds.input_shape
    stored = (ds, parts)
  base = model_lib.get(
    setting.model, num_classes, input_shape, compute_dtype=setting.compute_dtype
  )
  variables = base.init(jax.random.key(0))
  # The requested algorithm with its options; FedAvg beside it with none.
  names = dict.fromkeys([setting.algorithm, 'fedavg'])
  return _Clients(
    base=base,
    opt=optax.sgd(0.01, momentum=0.9),
    variables=variables,
    data=data,
    test_set=test_set,
    stored=stored,
    algorithms={n: runs_lib.algorithm(setting, n, base) for n in names},
  )


def _stored_clients(setting, sizes):
  """`(dataset, {kind: partition}, {kind: ClientData})` of a stored
  dataset split over N clients, for each size kind of `sizes`."""
  try:
    return _split_stored(setting, sizes)
  except errors.ArgumentError as e:
    raise setting_lib.data_error(e) from None


def _split_stored(setting, sizes):
  s, n = setting, setting.num_clients
  if s.random_data:
    m = s.random_train_size or (
      n * s.max_client_size if 'range' in sizes else 50_000
    )
    ds = datasets.random_images(s.dataset, m, min(m, 10_000))
  else:
    ds = datasets.load(s.dataset, s.data_dir or None)
  # The papers' minimum of 10 examples per client, relaxed when N is so
  # large that the average client holds fewer than 20.
  min_size = max(1, min(10, len(ds.y_train) // (2 * n)))
  make = {
    'equal': lambda: partition.iid(len(ds.y_train), n, 0),
    'dirichlet': lambda: partition.dirichlet(
      ds.y_train, n, s.alpha, 0, min_size=min_size
    ),
    'range': lambda: partition.sizes_between(
      len(ds.y_train), n, s.min_client_size, s.max_client_size, 0
    ),
  }
  try:
    parts = {k: make[k]() for k in sizes}
  except errors.ArgumentError as e:
    raise checks.partition_error(e, dataclasses.asdict(s)) from None
  data = {
    k: client_data.from_partition(ds.x_train, ds.y_train, p, ds.scale, ds.shift)
    for k, p in parts.items()
  }
  return ds, parts, data


def _bench_sizes(setting, sizes, devs, clients, torch_loop):
  """Times the settings of one client-size kind, interleaved.

  After one warm-up round each, every timed round runs once per device
  setting (the same clients: same key, same round index), followed by the
  limit at exactly that round's number of steps and, with `torch_loop`, a
  plain PyTorch FedAvg round on the same clients (checked to take the
  same number of steps). Each round/limit ratio and each device speed-up
  is taken between runs seconds apart, so drifts in the machine's speed
  (large on shared 2-core machines) cancel.
  """
  data = clients.data[sizes]
  runs, baseline = _prepare_runs(setting, sizes, devs, clients)
  b = min(setting.batch_size, int(data.max_size))
  lb = setting.limit_batch or b
  if setting.limit_batch and not setting_lib.synthetic(setting):
    if lb > data.x.shape[0]:
      raise errors.ConfigError(
        f'`limit_batch={lb}` exceeds the {data.x.shape[0]} training examples'
      )
  limit, flops = limit_lib.limit_fn(
    clients.base, clients.opt, clients.variables, data, lb, b
  )
  for r in ([baseline] if baseline else []) + runs:  # warm-up
    r['state'], m = r['step'](r['state'])
    jax.block_until_ready(r['state'])
  if setting.limit:
    limit(_limit_steps(setting, m), jax.random.key(0))
  if torch_loop is not None:
    torch_loop.round(m['client_ids'].tolist())  # warm-up
  torch_times = []
  for i in range(setting.rounds):
    pt_s = _timed_round(setting, i, runs, baseline, limit, torch_loop, data, b)
    if pt_s is not None:
      torch_times.append(pt_s)
  for r in runs:
    r['eval_s'] = timing.time_evaluation(r)
  return [
    report_lib.figures(
      r,
      flops,
      setting.eval_every,
      torch_times,
      baseline if r is runs[0] else None,
    )
    for r in runs
  ]


def _prepare_runs(setting, sizes, devs, clients):
  """The prepared runs of size kind `sizes`: one per device setting of
  `devs` and chunk of `client_chunks`, and FedAvg's beside another
  algorithm on the first device setting (None beside FedAvg)."""
  data, test_set = clients.data[sizes], clients.test_set
  name, algorithms = setting.algorithm, clients.algorithms
  runs = []
  for dev in devs:
    first = None
    for chunk in setting.client_chunks or [None]:
      runs.append(
        timing.prepare(
          setting,
          sizes,
          dev,
          data,
          test_set,
          name,
          algorithms[name],
          chunk,
          first,
        )
      )
      first = first or runs[-1]
  baseline = None
  if name != 'fedavg':
    baseline = timing.prepare(
      setting, sizes, devs[0], data, test_set, 'fedavg', algorithms['fedavg']
    )
  for r in runs:
    r['client_ids'] = []
  return runs, baseline


def _timed_round(setting, i, runs, baseline, limit, torch_loop, data, b):
  """Timed round `i`: once per device setting, then FedAvg beside another
  algorithm, the limit at that round's steps and the PyTorch round (whose
  seconds it returns; None without PyTorch). Appends to the runs'
  records."""
  for r in runs:
    m = timing.time_round(r, setting.local_epochs)
    r['client_ids'].append(tuple(int(c) for c in m['client_ids']))
    r['balance'].append(timing.balance(data, m['client_ids'], b, r['devices']))
  if baseline is not None:
    timing.time_round(baseline, setting.local_epochs)
  steps = {r['steps'][-1] for r in runs}
  if len(steps) != 1:
    raise RuntimeError(f'device settings ran different steps: {steps}')
  lim = math.nan
  if setting.limit:
    t = time.perf_counter()
    limit(_limit_steps(setting, m), jax.random.key(i + 1))
    lim = time.perf_counter() - t
  for r in runs:
    r['limits'].append(lim)
  if torch_loop is None:
    return None
  pt_s, pt_steps = torch_loop.round(m['client_ids'].tolist())
  if pt_steps != runs[-1]['steps'][-1]:
    raise RuntimeError(
      f'PyTorch took {pt_steps} steps, fedjax_mr {runs[-1]["steps"][-1]}'
    )
  return pt_s


def _limit_steps(setting, metrics) -> int:
  """The limit's steps for a round of `metrics`."""
  return limit_lib.limit_steps(
    int(metrics['num_steps']),
    int(metrics['num_examples']) * setting.local_epochs,
    setting.limit_batch,
  )
