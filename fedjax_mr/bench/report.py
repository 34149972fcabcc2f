"""What a benchmark measured: each setting's `Figures` (medians over its
timed rounds, ratios taken round by round) and the `Report`, with the text
of each line a program prints."""

from __future__ import annotations

import dataclasses
import resource
import statistics
from typing import Sequence

import jax
import numpy as np

from fedjax_mr.bench import setting as setting_lib
from fedjax_mr.bench import timing


@dataclasses.dataclass(frozen=True)
class Figures:
  """One timed setting: its per-round records and their medians.

  Per round (in order): `times` (seconds), `round_steps` (local steps of
  all clients), `limits` (the limit's seconds at that round's steps; NaN
  when not timed), `client_ids`. `ratio`, `overhead_s`, `overhead_pct`,
  `samples_per_s`, `gflops`, `pytorch_ratio` and `fedavg_ratio` are
  medians of per-round figures; `pytorch_*` and `fedavg_*` are None where
  not compared.
  """

  setting: str
  devices: int
  chunk: int
  compile_s: float
  round_s: float
  times: tuple[float, ...]
  round_steps: tuple[int, ...]
  limits: tuple[float, ...]
  client_ids: tuple[tuple[int, ...], ...]
  steps: float
  limit_s: float
  ratio: float
  overhead_s: float
  overhead_pct: float
  samples_per_s: float
  gflops: float
  server_pct: float
  eval_s: float
  evaluated: int
  test_examples: int
  eval_pct: float
  balance: float
  pytorch_s: float | None
  pytorch_ratio: float | None
  fedavg_s: float | None
  fedavg_ratio: float | None
  state_sha256: str


def figures(
  run: dict,
  flops: float,
  eval_every: int,
  torch_times: Sequence[float],
  baseline: dict | None,
) -> Figures:
  """The figures of the timed `run`: medians over its rounds; ratios to the
  PyTorch rounds `torch_times` (if any) and to FedAvg's `baseline` run
  (None: not compared). `flops`: of one local step."""
  times, steps, limits = run['times'], run['steps'], run['limits']
  round_s = statistics.median(times)
  med = statistics.median
  return Figures(
    setting=run['setting'],
    devices=run['devices'],
    chunk=run['chunk'],
    compile_s=run['compile_s'],
    round_s=round_s,
    times=tuple(times),
    round_steps=tuple(steps),
    limits=tuple(limits),
    client_ids=tuple(run['client_ids']),
    steps=med(steps),
    limit_s=med(limits),
    ratio=med([t / lim for t, lim in zip(times, limits)]),
    overhead_s=med([t - lim for t, lim in zip(times, limits)]),
    overhead_pct=med([100 * (t - lim) / t for t, lim in zip(times, limits)]),
    samples_per_s=med([e / t for e, t in zip(run['examples'], times)]),
    gflops=med([flops * st / t / 1e9 for st, t in zip(steps, times)]),
    server_pct=100 * run['server_s'] / round_s,
    eval_s=run['eval_s'],
    evaluated=run['evaluated'],
    test_examples=run['test_examples'],
    eval_pct=100 * run['eval_s'] / (eval_every * round_s),
    balance=med(run['balance']),
    pytorch_s=med(torch_times) if torch_times else None,
    pytorch_ratio=med([t / p for t, p in zip(times, torch_times)])
    if torch_times
    else None,
    fedavg_s=med(baseline['times']) if baseline is not None else None,
    fedavg_ratio=med(
      (t / st) / (tb / sb)
      for t, st, tb, sb in zip(
        times, steps, baseline['times'], baseline['steps']
      )
    )
    if baseline is not None
    else None,
    state_sha256=timing.state_sha256(run['state']),
  )


@dataclasses.dataclass(frozen=True)
class Report:
  """A benchmark's measurements and the lines that say them, in order.

  `results`: each timed setting's figures, size kind by size kind (the
  first is the setting the last lines speak of); `speedups`: {size kind:
  (median speed-up of all devices over 1, its bound)} where both ran;
  `peak_gflops`: the float32 and bfloat16 matmul peaks (None: not
  measured); `peak_host_mib`, `peak_device_mib` (None: not reported).
  """

  setting: setting_lib.Setting
  platform: str
  num_devices: int
  results: tuple[Figures, ...]
  speedups: dict[str, tuple[float, float]]
  peak_host_mib: float
  peak_device_mib: float | None
  peak_gflops: tuple[float, float] | None
  lines: tuple[str, ...]


def header_line(s: setting_lib.Setting, n_dev: int, platform: str) -> str:
  return (
    f'{s.algorithm}, {s.model} on {s.dataset}: K={s.clients_per_round} of '
    f'N={s.num_clients}, E={s.local_epochs}, B={s.batch_size}; '
    f'{n_dev} {platform} device(s), {s.rounds} timed '
    f'rounds; compute {s.compute_dtype}, matmul precision '
    f'{s.matmul_precision}' + (', random data' if s.random_data else '')
  )


def clients_line(data, alpha: float, beta: float) -> str:
  """What the generated clients `data` of Synthetic(`alpha`, `beta`) are."""
  sizes = np.asarray(data.sizes)
  return (
    f'Synthetic({alpha:g}, {beta:g}): '
    f'{len(sizes)} clients generated on demand, mean size '
    f'{sizes.mean():.2f}, at most {sizes.max()}; the limit generates its '
    'examples too (client 0, one batch a step)'
  )


def setting_line(r: Figures, s: setting_lib.Setting) -> str:
  """One setting's figures as one line."""
  return (
    f'[{r.setting}, {r.devices} device(s), chunk {r.chunk}] '
    f'compile {r.compile_s:.2f}s | round {r.round_s:.3f}s '
    f'({r.steps:.0f} steps) | '
    + (
      f'limit {r.limit_s:.3f}s | round/limit {r.ratio:.3f} '
      f"({1 / r.ratio:.3f} of the limit's samples/s) | "
      if s.limit
      else 'limit not timed | '
    )
    + f'{r.samples_per_s:.0f} samples/s '
    f'| {r.gflops:.1f} GFLOP/s | server {r.server_pct:.3f}% of '
    f'round | evaluation {r.eval_s:.3f}s ({r.evaluated} '
    f'model(s), {r.test_examples} test examples), '
    f'{r.eval_pct:.1f}% of {s.eval_every} rounds'
    + (
      f' | pytorch {r.pytorch_s:.3f}s, round/pytorch {r.pytorch_ratio:.3f}'
      if r.pytorch_s is not None
      else ''
    )
    + (
      f' | fedavg {r.fedavg_s:.3f}s, per-step ratio {r.fedavg_ratio:.3f}'
      if r.fedavg_ratio is not None
      else ''
    )
    + f' | state sha256 {r.state_sha256[:16]}'
  )


def speedups(
  results: Sequence[Figures], n_dev: int
) -> dict[str, tuple[float, float]]:
  """{size kind: (speed-up of `n_dev` devices over 1, its bound)}, round by
  round: each pair ran seconds apart on the same clients."""
  by = {(r.setting, r.devices): r for r in results}
  out = {}
  for sizes in dict.fromkeys(r.setting for r in results):
    if (sizes, 1) in by and (sizes, n_dev) in by and n_dev > 1:
      one, all_ = by[(sizes, 1)], by[(sizes, n_dev)]
      out[sizes] = (
        statistics.median(t1 / tn for t1, tn in zip(one.times, all_.times)),
        n_dev * all_.balance,
      )
  return out


def peak_memory_mib() -> tuple[float, float | None]:
  """This process's peak host memory and device 0's peak (None: the device
  does not say), in MiB."""
  peak_host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  stats = jax.devices()[0].memory_stats() or {}
  if 'peak_bytes_in_use' not in stats:
    return peak_host, None
  return peak_host, stats['peak_bytes_in_use'] / 2**20


def summary_lines(
  s: setting_lib.Setting,
  results: Sequence[Figures],
  n_dev: int,
  memory: tuple[float, float | None],
  peak: tuple[float, float] | None,
) -> list[str]:
  """The lines after the settings': device speed-ups, memory, the matmul
  peaks and the first setting's shares and ratios."""
  lines = [
    f'{sizes}: {n_dev} devices are {up:.2f}x faster than 1 '
    f'(clients dealt to devices allow at most {bound:.2f}x)'
    for sizes, (up, bound) in speedups(results, n_dev).items()
  ]
  line = f'peak host memory: {memory[0]:.0f} MiB'
  if memory[1] is not None:
    line += f'; peak device memory: {memory[1]:.0f} MiB'
  lines.append(line)
  first = results[0]
  if peak is not None:
    lines.append(
      f'matmul peak: float32 {peak[0]:.1f} GFLOP/s, bfloat16 {peak[1]:.1f} '
      f'GFLOP/s (default precision, device 0); the first setting reaches '
      f'{100 * first.gflops / peak[0]:.1f}% of the float32 peak'
    )
  lines.append(overhead_line(first, s))
  lines.append(
    f'evaluation share: {first.eval_pct:.1f}% (once per {s.eval_every} rounds)'
  )
  if first.fedavg_ratio is not None:
    lines.append(f'round/fedavg ratio: {first.fedavg_ratio:.2f}')
  if first.pytorch_ratio is not None:
    lines.append(f'round/pytorch ratio: {first.pytorch_ratio:.2f}')
  if s.limit:
    lines.append(f'round/limit ratio: {first.ratio:.2f}')
  return lines


def overhead_line(r: Figures, s: setting_lib.Setting) -> str:
  """Run `r`'s per-client overhead: what its round costs beyond the limit,
  per client and as a share of the round."""
  if not s.limit:
    return 'per-client overhead: not measured (`nolimit`)'
  per_client_ms = 1e3 * r.overhead_s / s.clients_per_round
  return (
    f'per-client overhead: {per_client_ms:.3g} ms/client '
    f'({r.overhead_pct:.1f}% of the round)'
  )
