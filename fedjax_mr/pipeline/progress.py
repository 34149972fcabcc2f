"""What a run says while it runs: the setting at the start, one line per
round (loss, accuracies, elapsed time, rounds/s, ETA) and a summary; for
a FedStitch run (`stitch_experiment`) its rounds' lines, the Local
baseline's and the closing lines."""

from __future__ import annotations

import collections
import os
from typing import Any
from typing import Callable
from typing import Mapping
from typing import NamedTuple

import jax
import numpy as np

from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.data import datasets
from fedjax_mr.pipeline import build
from fedjax_mr.pipeline import protection
from fedjax_mr.pipeline import records
from fedjax_mr.privacy import distributed_dp
from fedjax_mr.runtime import checkpoint
from fedjax_mr.runtime import distributed
from fedjax_mr.runtime import tensorboard
from fedjax_mr.training import engine
from fedjax_mr.training import host_round


def announce(
  experiment: build.Experiment,
  state: engine.RoundState,
  mapping: Mapping[str, Any],
  log: Callable[[str], None],
) -> None:
  """Logs the run's setting: algorithm, data, model, clients, rounds, the
  devices (`mapping`: `distributed.client_mapping`) and what the backend
  cannot promise.

  Args:
    experiment: the run about to start.
    state: its `RoundState` (restored, if the run resumes).
    mapping: how its clients are mapped onto the devices.
    log: where the lines go.
  """
  config, data, test = experiment.config, experiment.data, experiment.test
  host_data = isinstance(data, host_round.HostData)
  if host_data:
    data = data.data
  num_params = sum(x.size for x in jax.tree.leaves(state.server.params))
  if config.data.dataset == datasets.SYNTHETIC:
    log(_synthetic_line(experiment, num_params))
  else:
    log(
      f'{config.algorithm.name} on {config.data.dataset} '
      f'({int(data.num_examples)} '
      f'train / {int(jax.numpy.sum(test.mask))} test), {config.model.name} '
      f'({num_params:,} parameters), {data.num_clients} clients '
      f'({config.partition.kind}), {config.server.clients_per_round} per '
      'round, '
      f'{records.rounds(config.run.rounds)}'
    )
  unassigned = (experiment.partition or {}).get('unassigned', 0)
  if unassigned:
    log(
      f'note: {unassigned} of {int(data.num_examples)} training examples are '
      f'in no client (`partition={config.partition.kind}`)'
    )
  num_devices, platform = mapping['devices'], mapping['platform']
  per_device = distributed.clients_per_device(
    config.server.clients_per_round, num_devices
  )
  log(
    f'{num_devices} {platform} device(s) in {jax.process_count()} '
    f'process(es); {per_device} clients per device, '
    f'{mapping["client_chunk"]} at a time; {_placement(experiment)}'
  )
  note = distributed.reproducibility_note(platform, num_devices)
  if note:
    log(note)
  p = config.privacy
  acc = experiment.accountant
  if protection.distributed(p) and acc is not None:
    k = config.server.clients_per_round
    m = distributed_dp.min_clients(k, p.secure.threshold)
    log(
      f'privacy: distributed DP over secure aggregation, each update '
      f'clipped to {p.clip:g}'
      + (' (per layer)' if p.per_layer else '')
      + f', each client adding Skellam noise so that any {m} of the {k} '
      f'summed carry {p.noise_multiplier:g} × the clip norm (B = '
      f'{acc.bound:,.1f} integer units, d = {acc.dim:,}); every client '
      'weighing 1, no train loss; ε each round for δ = '
      + (f'{p.delta:g}' if p.delta else '1/N^1.1')
    )
  elif p.clip:
    log(
      f'privacy: DP-FedAvg, each update clipped to {p.clip:g}'
      + (' (per layer)' if p.per_layer else '')
      + (
        f' at first, then to the {p.adaptive_quantile:g} quantile of the norms'
        if p.adaptive_quantile
        else ''
      )
      + f', noise {p.noise_multiplier:g} × {p.clip:g} on the sum, every '
      'client weighing 1; ε each round for δ = '
      + (f'{p.delta:g}' if p.delta else '1/N^1.1')
    )


def _placement(experiment: build.Experiment) -> str:
  """Where the run keeps its training data, in words."""
  data = experiment.data
  if isinstance(data, host_round.HostData):
    mb = build.data_bytes(data.data) / 2**20
    where = (
      'memory-mapped from an unnamed file in the workdir'
      if client_data_lib.is_memory_mapped(data.data)
      else 'in host memory'
    )
    ahead = "the next round's gathered while one trains"
    if not experiment.config.devices.prefetch:
      ahead = 'not prefetched'
    elif not build.prefetches(experiment):
      ahead = "not prefetched: the sampler reads each round's result"
    return (
      f'training data {where} ({mb:,.1f} MiB), each round sending its '
      f"clients' examples (at most {data.capacity:,}; {ahead})"
    )
  if isinstance(data, client_data_lib.ClientData):
    mb = build.data_bytes(data) / 2**20
    return f'training data on every device ({mb:,.1f} MiB)'
  return 'training data generated on demand'


def _synthetic_line(experiment: build.Experiment, num_params: int) -> str:
  """`announce`'s first line for generated clients: α, β, N and the mean
  client size."""
  config, test = experiment.config, experiment.test
  sizes = np.asarray(experiment.client_sizes, np.int64)
  return (
    f'{config.algorithm.name} on synthetic(α={config.data.synthetic_alpha:g}, '
    f'β={config.data.synthetic_beta:g}): {len(sizes):,} clients generated on '
    f'demand, {sizes.mean():.2f} examples each on average '
    f'({sizes.min()}..{sizes.max()}; {sizes.sum():,} train / '
    f'{int(jax.numpy.sum(test.mask)):,} test), {config.model.name} '
    f'({num_params:,} parameters), {config.server.clients_per_round:,} per '
    'round, '
    f'{records.rounds(config.run.rounds)}'
  )


class Timer:
  """Elapsed time, rounds/s (after the compiling first round) and ETA."""

  def __init__(self, start: int, total: int):
    self.start, self.total = start, total
    self.elapsed = 0.0
    self.first = None  # time of this process's first (compiling) round
    self.steady: list[float] = []

  def tick(self, r: int, seconds: float) -> None:
    self.elapsed += seconds
    if self.first is None:
      self.first = seconds
    else:
      self.steady.append(seconds)

  def rate(self) -> float:
    times = self.steady or [self.first or 0.0]
    return 1.0 / max(float(np.mean(times)), 1e-9)

  def progress_line(self, row: dict[str, Any]) -> str:
    r = row['round']
    eta = (self.total - r) / self.rate()
    acc = (
      f' | test acc {row["test_accuracy"]:.4f}'
      if 'test_accuracy' in row
      else ''
    )
    if 'local_accuracy_mean' in row:
      # The FedMR family keeps K models; the next round dispatches them.
      k = len(row.get('client_ids', ())) or 'K'
      acc += (
        f" | next round's {k} models: mean test acc "
        f'{row["local_accuracy_mean"]:.4f}'
      )
    if 'dp_epsilon' in row:
      acc += f' | ε {row["dp_epsilon"]:.3g}'
    loss = row['train_loss']
    # None (or NaN) where the clients upload none (distributed DP).
    loss = f'{loss:.4f}' if loss is not None and loss == loss else 'n/a'
    return (
      f'round {r}/{self.total} | train loss {loss}{acc} | '
      f'elapsed {self.elapsed:.1f}s | {self.rate():.2f} rounds/s | '
      f'ETA {eta:.0f}s'
    )

  def summary(self, history: list[dict[str, Any]], workdir: str) -> str:
    evals = [r for r in history if 'test_accuracy' in r]
    lines = [
      f'done: {records.rounds(self.total)}; this process ran '
      f'{self.total - self.start} in {self.elapsed:.1f}s'
    ]
    if self.first is not None:
      lines[0] += (
        f' (first round incl. compile {self.first:.1f}s, then '
        f'{1 / self.rate():.2f}s/round)'
      )
    if evals:
      best = max(evals, key=lambda r: r['test_accuracy'])
      last = evals[-1]
      lines.append(
        f'final test accuracy {last["test_accuracy"]:.4f} (loss '
        f'{last["test_loss"]:.4f}) at round {last["round"]}; best '
        f'{best["test_accuracy"]:.4f} at round {best["round"]}'
      )
    lines.append(f'workdir {workdir}: {", ".join(written_files(workdir))}')
    return '\n'.join(lines)


# What a run's workdir holds when it is done, in the summary's order.
RUN_FILES = (
  records.METRICS_FILE,
  records.CLIENTS_FILE,
  records.CONFIG_FILE,
  records.PARTITION_FILE,
  records.CURVE_FILE,
  tensorboard.FOLDER + '/',
  checkpoint.FOLDER + '/',
)


def written_files(workdir: str) -> list[str]:
  """The files and folders of `RUN_FILES` that `workdir` holds (folders
  with a trailing /): partition.json only for a partitioned dataset,
  tensorboard/ only with `tensorboard`."""
  return [
    name
    for name in RUN_FILES
    if os.path.exists(os.path.join(workdir, name.rstrip('/')))
  ]


# --- FedStitch runs (experiments.stitch) -------------------------------------


class Pace(NamedTuple):
  """Where this process stands in a run, for a progress line's timing.

  Attributes:
    elapsed_s: seconds since this process began (or resumed) the run.
    ran: the rounds this process ran (none from before a resume).
    limit: the most rounds the run can take (`federated.round_limit`).
  """

  elapsed_s: float
  ran: int
  limit: int


def pace_text(pace: Pace, done: int) -> str:
  """`'12/≤35 rounds | elapsed 48.0s | 0.25 rounds/s | ETA ≤ 92s'` after
  `done` rounds of the run: the elapsed time and rate are this process's
  (a resumed run counts only its own rounds), and the ETA is the rounds
  still possible (`pace.limit` − `done`) at the mean round time so far. It
  bounds the rounds, not their time: a run can end sooner (every network
  finished), and its rounds get cheaper as the pools shrink, but a round
  is not promised to be as fast as the mean."""
  mean = pace.elapsed_s / max(pace.ran, 1)
  left = max(pace.limit - done, 0)
  return (
    f'{done}/≤{pace.limit} rounds | elapsed {pace.elapsed_s:.1f}s | '
    f'{1 / max(mean, 1e-9):.2f} rounds/s | ETA ≤ {left * mean:.0f}s'
  )


def configs_text(clients: list[dict[str, Any]]) -> str:
  """The clients' energy configurations, each once with its count, most
  frequent first (ties: first seen), e.g. `'table2_3_MAXN ×7, table2_2
  ×3'`."""
  counts = collections.Counter(c['config'] for c in clients)
  return ', '.join(f'{name} ×{n}' for name, n in counts.most_common())


def stitch_round_lines(
  entry: dict[str, Any], pace: Pace | None = None
) -> list[str]:
  """A round's progress lines: depth, pool sizes, selection time, client
  weights, and with `pace` how far the run is (`pace_text`); its energy,
  with the configurations chosen and how many clients chose each (every
  client's is in energy.jsonl); the blocks selected."""
  w = entry['weights']
  lines = [
    f'round {entry["round"]:3d}  depth {entry["depth"]}  pool '
    f'{",".join(map(str, entry["pool_sizes"]))}  selection '
    f'{sum(entry["client_time_s"]):.2f} s  weights: effective '
    f'{w["effective_clients"]:.1f} clients, max {w["max"]:.2f}×, min '
    f'{w["min"]:.2f}×'
  ]
  if pace is not None:  # log entries count rounds from 0
    lines[0] += ' | ' + pace_text(pace, entry['round'] + 1)
  en = entry.get('energy')
  if en is not None:
    met = [c['met'] for c in en['clients']]
    lines.append(
      f'    energy {en["energy_j"]:.1f} J (highest frequency '
      f'{en["default_energy_j"]:.1f} J); '
      + (
        'no deadline yet'
        if en['deadline_s'] is None
        else f'deadline {en["deadline_s"]:.2f} s, met by {sum(met)}/{len(met)}'
      )
      + '; configs '
      + configs_text(en['clients'])
    )
  for s in entry.get('selected', []):
    if 'block' in s:
      lines.append(
        f'    {s["network"]}  +  {s["block"]}  (votes {s["votes"]:.1f}, '
        f'CKA {s["mean_cka"]:.3f})'
      )
  return lines


def stitch_local_line(
  i: int, who: list[int], best: float, networks: int, elapsed_s: float
) -> str:
  """The line after the `i`-th (from 1) of the Local searches of clients
  `who`: the best accuracy of its `networks`, the seconds since the first
  began and the ETA of the others at the mean search time so far."""
  left = (len(who) - i) * elapsed_s / i
  return (
    f'Local {i}/{len(who)} (client {who[i - 1]} alone): best '
    f'{100 * best:.2f} % of {networks} networks | elapsed {elapsed_s:.1f}s '
    f'| ETA {left:.0f}s'
  )


def stitch_summary_lines(
  results: dict[str, Any], key: str, sysfs_writes: int
) -> list[str]:
  """The closing lines: networks, the best (by accuracy `key`), each pool
  model, the Local baseline, the energy totals (and the coordinators'
  `sysfs_writes`), the peak memory."""
  nets, local, en = results['networks'], results['local'], results['energy']
  lines = [
    f'{len(nets)} stitched networks in {results["rounds"]} rounds '
    f'({results["run_seconds"]:.0f} s; client selection time '
    f'{results["selection_seconds_total"]:.1f} s); best: '
    + (f'{nets[0]["path"]} {100 * nets[0][key]:.2f} %' if nets else 'none')
  ]
  for m, acc in results['pool_models'].items():
    lines.append(f'pool model {m} alone: {100 * acc[key]:.2f} %')
  if local:
    lines.append(
      f"Local (mean of {len(local['clients'])} clients' best): "
      f'{100 * local["mean_best"]:.2f} %'
    )
  lines.append(
    f'energy ({en["backend"]}, {en["devices"]}): local coordinators '
    f'{en["coordinated_energy_j"]:.1f} J vs {en["default_energy_j"]:.1f} J '
    f'at the highest frequency, saving {100 * en["energy_saving"]:.1f} % '
    f'(time {100 * en["time_change"]:+.1f} %, {en["missed"]} missed deadlines'
    + (
      ''
      if en['backend'] == 'simulated'
      else f'; {sysfs_writes} sysfs writes'
      + (', planned only' if en['backend'] == 'dry_run' else '')
    )
    + '); per client and round in energy.jsonl'
  )
  lines.append(f'peak host memory {results["peak_host_mib"]:.0f} MiB')
  return lines
