"""A finished run's rounds replayed on simulated devices (`energy_mix`):
the energy the coordinator saves against the highest frequency, written
to `energy.json` and one line per mix."""

from __future__ import annotations

import os
from typing import Any
from typing import Callable

from fedjax_mr.energy import simulation
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.runtime import metrics_io

ENERGY_FILE = 'energy.json'


def simulate_energy(
  config: config_lib.ExperimentConfig,
  history: list[dict[str, Any]],
  sizes: list[int],
) -> dict[str, dict[str, Any]]:
  """Each `energy_mix` simulated on a run's rounds (coordinator vs the
  highest frequency).

  Args:
    config: the run (its mixes, seed, local epochs, time per example).
    history: the metrics rows, with each round's `client_ids`.
    sizes: every client's number of training examples.

  Returns:
    {mix: `SimulationReport.summary()`}; rounds logged before client ids
    were recorded are left out (`rounds_simulated` says how many count).
  """
  rows = [row for row in history if 'client_ids' in row]
  ids = [row['client_ids'] for row in rows]
  work = simulation.training_workloads(
    ids, sizes, config.local.local_epochs, config.energy.ms_per_sample / 1000
  )
  out = {}
  for mix in config_lib.energy_mixes(config.energy):
    clients = simulation.assign_profiles(mix, len(sizes), config.run.seed)
    report = simulation.simulate(work, clients, client_ids=ids)
    out[mix] = {**report.summary(), 'rounds_simulated': len(rows)}
  return out


def energy_line(mix: str, e: dict[str, Any]) -> str:
  """One progress line for a simulated mix."""
  return (
    f'energy, {mix}: coordinator saves {100 * e["energy_saving"]:.1f} % '
    f'({e["default_energy_j"]:.0f} J → {e["coordinated_energy_j"]:.0f} J), '
    f'time {100 * e["time_change"]:+.1f} %, {e["missed"]} missed deadlines '
    f'over {e["rounds_simulated"]} rounds'
  )


def write(
  config: config_lib.ExperimentConfig,
  history: list[dict[str, Any]],
  sizes: list[int],
  workdir: str,
  log: Callable[[str], None],
) -> None:
  """Simulates the config's mixes on `history`, writes energy.json in
  `workdir` and logs one line per mix."""
  energy = simulate_energy(config, history, sizes)
  metrics_io.write_json(os.path.join(workdir, ENERGY_FILE), energy, indent=1)
  for mix, e in energy.items():
    log(energy_line(mix, e))
