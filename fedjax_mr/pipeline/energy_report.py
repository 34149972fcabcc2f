"""The energy side of a run, from its config: a finished training run's
rounds replayed on simulated devices (`energy_mix`, `simulate_energy`):
the energy the coordinator saves against the highest frequency, written
to `energy.json` and one line per mix; and a FedStitch run's clients'
energy coordinators (`make_fleet`): simulated devices, this device's
clocks through sysfs (a Jetson), or, on a deployed run's server,
coordinators that run on the clients' own devices. Every message names
the config field (in backticks)."""

from __future__ import annotations

import os
from typing import Any
from typing import Callable

from fedjax_mr import energy
from fedjax_mr.core import errors
from fedjax_mr.energy import fleet
from fedjax_mr.energy import simulation
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import stitch_config
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


def make_fleet(
  part: stitch_config.Energy,
  num_clients: int,
  seed: int,
  *,
  deployed: bool = False,
) -> fleet.Fleet:
  """The clients' energy coordinators of `energy_backend` (`num_clients`
  simulated devices drawn by `seed`, or this device through sysfs); a bad
  setting is refused (`ConfigError`) before the data loads, and nothing
  is written. `deployed`: the server's view of a deployed run, whose
  coordinators run on the clients' own devices (`fleet.RemoteBackend`)."""
  seconds = part.ms_per_score / 1000
  if deployed:
    return fleet.Fleet(
      fleet.RemoteBackend(part.backend), seconds_per_unit=seconds
    )
  if part.backend == 'simulated':
    try:
      devices = simulation.assign_profiles(part.mix, num_clients, seed)
    except (ValueError, OSError) as e:
      raise errors.ConfigError(f'`energy_mix={part.mix!r}`: {e}') from None
    return fleet.Fleet(
      fleet.SimulatedBackend(devices), seconds_per_unit=seconds
    )
  return fleet.Fleet(_sysfs_backend(part), seconds_per_unit=seconds)


def _sysfs_backend(part: stitch_config.Energy) -> fleet.SysfsBackend:
  """This device's clocks through sysfs (or a dry run): its profile must
  fit the device, and a real run must be allowed to write the clocks."""
  where = f'`energy_sysfs_root={part.sysfs_root}`'
  root = energy.SysfsRoot(part.sysfs_root)
  if not root.is_dir('.'):
    raise errors.ConfigError(f'{where}: no such directory')
  try:
    profile = energy.get_profile(part.profile)
  except (ValueError, OSError, TypeError, KeyError) as e:
    raise errors.ConfigError(f'`energy_profile={part.profile}`: {e}') from None
  try:
    info = energy.discover(root)
    meter = energy.SysfsPowerMeter(root, info.power_channels)
    plan = energy.SysfsDvfs(root, info, dry_run=True)
    for setting in profile.configs:  # Each must fit this device.
      plan.apply(setting)
  except energy.EnergyError as e:
    raise errors.ConfigError(
      f'{where} with `energy_profile={part.profile}`: {e}'
    ) from None
  if part.backend == 'sysfs':
    for rel, _ in plan.writes:
      if not os.access(root.path(rel), os.W_OK):
        raise errors.ConfigError(
          f'`energy_backend=sysfs` may not write {root.path(rel)}: '
          'changing clocks needs root (run with sudo), or use '
          '`energy_backend=dry_run`'
        )
  dvfs = energy.SysfsDvfs(root, info, dry_run=part.backend == 'dry_run')
  return fleet.SysfsBackend(dvfs, profile, meter.total_w)
