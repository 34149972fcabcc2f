"""Lists a Jetson's DVFS knobs and power rails, and measures a device profile.

  # What the board has and what would be written; changes nothing:
  python -m experiments.profile_device --dry_run
  # Measure a profile (needs root) and save it as JSON:
  sudo .venv/bin/python -m experiments.profile_device --output=tx2.json
  # The paper's three TX2 configurations, through nvpmodel:
  sudo ... --configs=tx2_table2 --backend=nvpmodel --output=tx2.json

The built-in workload is numpy matmuls (CPU); library users pass their own
workload to `fedjax_mr.energy.measure_profile`. Clocks are restored on exit,
also after an error, Ctrl-C or SIGTERM.
"""

# First: Ctrl-C while the modules below import ends in one line (cli).
from . import cli  # isort: split

import logging
import sys

from absl import flags

from fedjax_mr import energy
from fedjax_mr.energy import profiling

CONFIG_SETS = ('sweep', 'tx2_table2', 'tx2_nvpmodel')

_SYSFS_ROOT = flags.DEFINE_string(
  'sysfs_root', '/', 'Root of the sysfs tree (a fake tree in tests).'
)
_DRY_RUN = flags.DEFINE_bool(
  'dry_run', False, 'List the device and the planned writes; change nothing.'
)
_CONFIGS = flags.DEFINE_enum(
  'configs',
  'sweep',
  CONFIG_SETS,
  "Configurations: an even sweep of the frequency tables, the paper's TX2"
  ' Table II, or the five TX2 nvpmodel modes.',
)
_LEVELS = flags.DEFINE_integer(
  'levels', 3, 'Number of sweep levels (with --configs=sweep).', lower_bound=1
)
_BACKEND = flags.DEFINE_enum(
  'backend', 'sysfs', ('sysfs', 'nvpmodel'), 'How clocks are set.'
)
_SNAP = flags.DEFINE_enum(
  'snap', 'floor', energy.dvfs.SNAP_RULES, 'How clocks snap to the tables.'
)
_CPU_METHOD = flags.DEFINE_enum(
  'cpu_method',
  'limits',
  energy.sysfs_dvfs.CPU_METHODS,
  'Pin CPU clocks with min = max limits or the userspace governor.',
)
_ALLOW_EMC = flags.DEFINE_bool(
  'allow_emc', False, 'Also set the EMC clock of configs that have one.'
)
_WORKLOAD_SIZE = flags.DEFINE_integer(
  'workload_size', 256, 'Matrix size of the matmul workload.', lower_bound=1
)
_WORKLOAD_STEPS = flags.DEFINE_integer(
  'workload_steps', 20, 'Matmuls per workload run.', lower_bound=1
)
_REPEATS = flags.DEFINE_integer(
  'repeats', 3, 'Timed workload runs per configuration.', lower_bound=1
)
_IDLE_S = flags.DEFINE_float(
  'idle_s', 2.0, 'Seconds of idle power measurement.', lower_bound=0.0
)
_PERIOD_S = flags.DEFINE_float(
  'period_s', 0.02, 'Power sampling period in seconds.', lower_bound=1e-4
)
_SETTLE_S = flags.DEFINE_float(
  'settle_s', 0.1, 'Seconds to wait before reading clocks back.', lower_bound=0
)
_OUTPUT = flags.DEFINE_string(
  'output', None, 'Where to save the measured profile (JSON).'
)
_NAME = flags.DEFINE_string(
  'name', None, 'Profile name (default: from the board model).'
)


def _configs(info: energy.DeviceInfo) -> tuple[energy.DvfsConfig, ...]:
  if _CONFIGS.value == 'tx2_table2':
    return energy.TX2_TABLE2_LITERAL.configs
  if _CONFIGS.value == 'tx2_nvpmodel':
    return energy.TX2_NVPMODEL_MODES
  return profiling.sweep_configs(info, _LEVELS.value)


def _backend(root: energy.SysfsRoot, info: energy.DeviceInfo):
  if _BACKEND.value == 'nvpmodel':
    return energy.NvpmodelDvfs(root=root, info=info, dry_run=_DRY_RUN.value)
  return energy.SysfsDvfs(
    root,
    info,
    snap_rule=_SNAP.value,
    cpu_method=_CPU_METHOD.value,
    allow_emc=_ALLOW_EMC.value,
    dry_run=_DRY_RUN.value,
    settle_s=_SETTLE_S.value,
  )


def _print_plan(backend, configs) -> None:
  print('\nplanned changes (dry run; nothing is written):')
  for config in configs:
    if isinstance(backend, energy.SysfsDvfs):
      start = len(backend.writes)
      result = backend.apply(config)
      steps = [
        f'echo {value} > {backend.root.path(rel)}'
        for rel, value in backend.writes[start:]
      ]
    else:
      result = backend.apply(config)
      steps = [' '.join(backend.commands[-1])]
    print(f'  {result.requested.describe()}')
    for step in steps:
      print(f'    {step}')


def _error(message: str, code: int = 1) -> int:
  """Prints a one-line error; the exit code to return (2: bad usage)."""
  print(f'error: {message}', file=sys.stderr)
  return code


def main(argv):
  if len(argv) > 1:
    return _error(f'unexpected arguments: {" ".join(argv[1:])}', 2)
  root = energy.SysfsRoot(_SYSFS_ROOT.value)
  if not root.is_dir('.'):
    return _error(f'--sysfs_root {_SYSFS_ROOT.value} is no directory', 2)
  if not _DRY_RUN.value and not _OUTPUT.value:
    return _error('--output is required unless --dry_run is given', 2)
  logging.getLogger('fedjax_mr.energy').setLevel(logging.INFO)

  info = energy.discover(root)
  print(energy.describe(root, info))
  try:
    configs = _configs(info)
    missing = [c.name for c in configs if c.nvpmodel_id is None]
    if _BACKEND.value == 'nvpmodel' and missing:
      return _error(
        '--backend=nvpmodel needs --configs=tx2_table2 or tx2_nvpmodel'
        f' (not nvpmodel modes: {", ".join(missing)})',
        2,
      )
    backend = _backend(root, info)
    if _DRY_RUN.value:
      _print_plan(backend, configs)
      return 0
    meter = energy.SysfsPowerMeter(root, info.power_channels)
    workload = profiling.matmul_workload(
      _WORKLOAD_SIZE.value, _WORKLOAD_STEPS.value
    )
    name = _NAME.value or (info.model or 'device').lower().replace(' ', '_')
    with backend:
      profile = energy.measure_profile(
        backend,
        meter.total_w,
        configs,
        workload,
        name=name,
        repeats=_REPEATS.value,
        idle_s=_IDLE_S.value,
        period_s=_PERIOD_S.value,
        description=(
          f'measured on {info.model} with {_WORKLOAD_STEPS.value} numpy'
          f' matmuls of {_WORKLOAD_SIZE.value}x{_WORKLOAD_SIZE.value}'
        ),
      )
  except energy.EnergyError as e:
    return _error(str(e))
  energy.save_profile(profile, _OUTPUT.value)
  print(f'\nprofile {profile.name} saved to {_OUTPUT.value}:')
  print(f'  idle {profile.p_idle_w:.3f} W')
  for config, up, watts in zip(
    profile.configs, profile.speedup, profile.p_active_w
  ):
    print(f'  {config.name}: speed-up {up:.3f}, {watts:.3f} W')
  return 0


def entry() -> None:
  """The console script `fedjax-mr-profile-device`."""
  cli.run(main)


if __name__ == '__main__':
  entry()
