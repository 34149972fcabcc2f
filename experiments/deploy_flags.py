"""The deploy programs' flags (experiments.deploy, experiments.deploy_stitch):
the federation they start or the SuperLink they submit to
(`define_deploy_flags`), their values as `launch.run`'s arguments
(`deploy_arguments`), and every path flag made absolute before anything
starts (`absolute_paths`).
"""

from __future__ import annotations

import os

from absl import flags

from . import cli


def define_deploy_flags() -> tuple[str, ...]:
  """Defines the flags of a federation the deploy programs start or use
  (`--nodes`, `--round_timeout`, `--superlink`, ...); returns their names,
  in the order the programs' `--help` lists them."""
  _define_local_federation_flags()
  _define_superlink_flags()
  return (
    'nodes',
    'round_timeout',
    'insecure_federation',
    'federation_host',
    'expose_federation',
    'flower_logs',
    'warm_superexec',
    'node_heartbeat_s',
    'superlink',
    'root_certificates',
    'operator_token',
    'node_ids',
  )


def _define_local_federation_flags() -> None:
  """The flags of the federation a deploy program starts here."""
  flags.DEFINE_integer(
    'nodes', 2, 'SuperNodes to start (node i serves clients i, i + N, ...).'
  )
  flags.DEFINE_float(
    'round_timeout',
    0.0,
    'Seconds a round waits for its replies (0: no deadline); clients '
    'without a reply by then count as failed (the clients row names them).',
  )
  flags.DEFINE_bool(
    'insecure_federation',
    False,
    'Run without TLS and node authentication (prints a warning).',
  )
  flags.DEFINE_string(
    'federation_host',
    '127.0.0.1',
    'The address the SuperLink listens on (its certificate names it); an '
    'address other machines reach needs --expose_federation.',
  )
  flags.DEFINE_bool(
    'flower_logs',
    False,
    "Print Flower's own log lines too (they are always in "
    '<workdir>/flower/logs).',
  )
  flags.DEFINE_bool(
    'expose_federation',
    False,
    'Let the SuperLink started here listen on a --federation_host that '
    'other machines reach (prints what that exposes, and to whom).',
  )

  flags.DEFINE_bool(
    'warm_superexec',
    True,
    "Start each message's ClientApp process (and the ServerApp) as a fork "
    "of a SuperExec that has already imported them (Flower's process "
    'isolation, fedjax_mr.deploy.flower.warm); --nowarm_superexec: '
    "Flower's own SuperExec, a fresh process importing Flower and JAX for "
    'every message.',
  )
  flags.DEFINE_float(
    'node_heartbeat_s',
    0.0,
    'Seconds between the heartbeats of the SuperNodes started here (10 to '
    "1800; 0: Flower's 30): the SuperLink fails the clients of a node that "
    'died two intervals after its last beat.',
  )


def _define_superlink_flags() -> None:
  """The flags of a SuperLink running elsewhere to submit the run to."""
  flags.DEFINE_string(
    'superlink',
    '',
    'host:port of a SuperLink running elsewhere (a real fleet, whose '
    'SuperNodes have the node configs node-index=i num-nodes=N): the run '
    'is submitted to it instead of a federation started here.',
  )
  flags.DEFINE_string(
    'root_certificates',
    '',
    "With --superlink: the CA certificate file of the SuperLink's TLS "
    'certificate (without it, --insecure_federation must say so).',
  )
  flags.DEFINE_string(
    'operator_token',
    '',
    "With --superlink: the file of the operator's token, which the "
    "SuperLink's Control API accepts alone (python -m "
    'fedjax_mr.deploy.flower.superlink --operator-token-file).',
  )
  flags.DEFINE_list(
    'node_ids',
    [],
    "With --superlink: node 0's Flower id, node 1's, ... (what `flwr "
    'supernode register` printed); a node is never asked its index, so a '
    'secure SuperLink needs them.',
  )


# The deploy programs' flags that name a file or a folder. The
# federation's processes run in `<workdir>/flower`, where a relative path
# names another file or none: `absolute_paths` makes them absolute.
_PATH_FLAGS = (
  'workdir',
  'data_dir',
  'partition_file',
  'init_from',
  'pool',
  'imagenet_pool',
  'root_certificates',
  'operator_token',
  'energy_sysfs_root',
)


def absolute_paths(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Makes each path the parsed flags name absolute, from this working
  folder: the `_PATH_FLAGS` that are set, and `--label_map`,
  `--energy_profile` and each profile of `--energy_mix` where they name a
  file here rather than a bundled map or profile (a name that is neither
  stays as given, for the config's check to name). Run before anything
  starts, so that the launcher's checks and the federation's processes
  read the same files."""
  from fedjax_mr.energy import profiles
  from fedjax_mr.stitch import label_maps

  def absolute(name: str, bundled=None) -> None:
    value = flag_values[name].value if name in flag_values else None
    if value and (bundled is None or _a_file(value, bundled)):
      setattr(flag_values, name, os.path.abspath(value))

  for name in _PATH_FLAGS:
    absolute(name)
  absolute('label_map', label_maps.BUNDLED)
  absolute('energy_profile', profiles.BUILTIN_PROFILES)
  if 'energy_mix' in flag_values and flag_values['energy_mix'].value:
    flag_values.energy_mix = _mix_files_absolute(
      flag_values['energy_mix'].value, profiles.BUILTIN_PROFILES
    )


def _mix_files_absolute(spec: str, builtin) -> str:
  """`spec` (`profile[@speed][:weight]` entries, separated by ',' within
  a mix and ';' between mixes) with each profile that is a file here, not
  one in `builtin`, made absolute; an entry that does not parse is left
  for the config's check to name."""
  from fedjax_mr.energy import simulation

  mixes = []
  for mix in spec.split(';'):
    entries = []
    for entry in mix.split(','):
      try:
        ((name, _, _),) = simulation.parse_mix(entry)
      except ValueError:
        name = ''
      if name and _a_file(name, builtin):
        entry = entry.replace(name, os.path.abspath(name), 1)
      entries.append(entry)
    mixes.append(','.join(entries))
  return ';'.join(mixes)


def _a_file(value: str, bundled) -> bool:
  """Whether `value` of a flag that names a bundled thing or a file is a
  file (or folder) here rather than a name in `bundled`."""
  return value not in bundled and os.path.lexists(value)


def deploy_arguments() -> dict:
  """The deploy flags' values as `launch.run`'s keyword arguments."""
  from fedjax_mr.deploy import federation

  f = flags.FLAGS
  superlink = None
  if f.superlink:
    try:
      ids = tuple(int(n) for n in f.node_ids)
    except ValueError:
      cli.fail(f'--node_ids={",".join(f.node_ids)}: not node ids (integers)')
    superlink = federation.Remote(
      f.superlink, f.root_certificates or None, ids, f.operator_token or None
    )
  elif f.root_certificates or f.node_ids or f.operator_token:
    cli.fail(
      '--root_certificates, --operator_token and --node_ids go with --superlink'
    )
  return dict(
    round_timeout=f.round_timeout,
    insecure=f.insecure_federation,
    host=f.federation_host,
    log=cli.log,
    superlink=superlink,
    warm=f.warm_superexec,
    node_heartbeat_s=f.node_heartbeat_s,
    expose=f.expose_federation,
    flower_logs=f.flower_logs,
  )
