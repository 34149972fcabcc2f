r"""FedStitch on a dataset with a pool of pre-trained models.

  python -m experiments.pretrain_zoo --workdir=runs/pool
  python -m experiments.stitch --pool=runs/pool --partition=dirichlet \
      --alpha=1.0 --workdir=runs/stitch/dir1.0

The clients (`--num_clients`, default 100) hold the dataset's training
examples that are not in the pool's public split, partitioned IID or by
Dirichlet(α); `--clients_per_round` (10) take part in each round. Prints
per-round progress (depth, pool size, selected blocks, client weights) and
writes, under `--workdir`:

* `log.jsonl`: one line per round (participants, their selection times,
  pool sizes, ranks, weight summary, selections);
* `energy.jsonl`: one line per round from the clients' local energy
  coordinators (FedStitch §IV-D), which run in the loop: the server's
  deadline and, per participant, the chosen DVFS configuration, predicted
  and measured time, energy, whether the deadline was met, and the same
  work at the highest frequency (`fedjax_mr.energy.fleet`). The devices are
  simulated (`--energy_backend=simulated`, a `--energy_mix` of profiles and
  speeds), or the Jetson the run is on, whose clocks are set through sysfs
  (`sysfs`; restored at the end, also after an error) or only planned
  (`dry_run`), with `--energy_profile`;
* `results.json`: every stitched network (path, accuracy by its head and/or
  a kNN probe), every pool model's own accuracy, the "Local" baseline when
  `--local_clients` > 0, timing, pool sizes, the energy totals (local
  coordinators vs the highest frequency) and the peak host memory;
* `partition.json`: each client's size and examples per class (as
  `experiments.run` writes it);
* `client_indices.json`: each client's training-example indices, for
  `experiments.run --partition=file --partition_file=...` (with the same
  `--classes`): the training baselines learn from exactly these clients;
* `networks.npz`: the stitched networks (block paths + stitch matrices;
  `fedjax_mr.stitch.state.read_document` reads it);
* `state.npz`: the run state after the last round and the flags that
  define the run (a re-run with the same flags resumes; other flags are
  refused). Neither file is a pickle: nothing is ever unpickled.

Pool models whose labels differ from the dataset's need `--label_map`, a
JSON list with, per dataset class, the pool classes that count as it.

A transfer setting: `--classes=5-9` gives the clients (and the test set)
those classes only; with a pool trained on others (`experiments.pretrain_zoo
--classes=0-4`) no head answers the task, and networks are evaluated by a
kNN probe (`--eval=knn`) fitted on the public examples of the clients'
classes, which the pool never saw.

`--imagenet_pool=<folder>` replaces `--pool` with FedStitch's own pool: the
five ImageNet-1K networks, read from torchvision state dicts saved as
`.safetensors` (`fedjax_mr.stitch.torchvision_import`); images are resized
to `--imagenet_resolution` and ImageNet-normalised at the start of every
model, and `--label_map` maps ImageNet classes to the dataset's (for
CIFAR-10 and CINIC-10 the bundled map `fedjax_mr.stitch.label_maps.CIFAR10`
is the default, so the paper's pool runs with that one flag).
"""

from __future__ import annotations

import json
import os

from absl import flags
from absl import logging

from . import cli

_POOL = flags.DEFINE_string('pool', 'runs/pool', 'Pool folder.')
_POOL_MODELS = flags.DEFINE_list(
  'pool_models', [], 'Pool model ids to use (default: all in --pool).'
)
_IMAGENET_POOL = flags.DEFINE_string(
  'imagenet_pool',
  None,
  "FedStitch's ImageNet pool instead of --pool: a folder of torchvision "
  'state dicts as .safetensors (alexnet, resnet50, vgg16, densenet121, '
  'mobilenet_v3_large); --label_map defaults to the bundled map of '
  '--dataset where there is one (cifar10, cinic10).',
)
_IMAGENET_RESOLUTION = flags.DEFINE_integer(
  'imagenet_resolution', 224, 'Side images are resized to (--imagenet_pool).'
)
# The library's choices (fedjax_mr.stitch: blocks.CUT_STYLES, cka.VIEWS,
# projection.SPATIAL_POLICIES and SOLVERS, config.AGGREGATIONS,
# network.EVAL_MODES; a test checks they agree), here so that --help does
# not import JAX.
CHOICES = {
  'cuts': ['default', 'per_linear', 'every_unit'],
  'view': ['positions', 'flatten', 'gap'],
  'spatial': ['match', 'fit_only'],
  'stitch_solver': ['pinv', 'ridge'],
  'aggregation': ['rl', 'uniform'],
  'eval': ['head', 'knn', 'both'],
}
_CUTS = flags.DEFINE_enum(
  'cuts', 'default', CHOICES['cuts'], 'Where models are cut into blocks.'
)
_DATASET = flags.DEFINE_string('dataset', 'fashion_mnist', 'Dataset.')
_DATA_DIR = flags.DEFINE_string('data_dir', None, 'Dataset folder.')
_NUM_CLIENTS = flags.DEFINE_integer('num_clients', 100, 'Clients N.')
_PARTITION = flags.DEFINE_enum(
  'partition',
  'dirichlet',
  ['iid', 'dirichlet', 'dirichlet_equal', 'shards'],
  'Client partition: iid; dirichlet (each class split over the clients by '
  'Dir(--alpha), as experiments.run); dirichlet_equal (equal-size clients, '
  "each with class proportions from Dir(--alpha): FedStitch's non-IID "
  'setting, and the one that stays non-empty with few classes); shards '
  '(the label-sorted shards of experiments.run, --shards_per_client: a '
  "client holds few classes; FedStitch's Fig. 2).",
)
_SHARDS_PER_CLIENT = flags.DEFINE_integer(
  'shards_per_client', 2, 'partition=shards: shards per client.'
)
_ALPHA = flags.DEFINE_float(
  'alpha',
  1.0,
  'Dirichlet concentration (partition=dirichlet or dirichlet_equal).',
)
# The flag's name before it was unified with experiments.run's.
flags.DEFINE_alias('dirichlet_alpha', 'alpha')
_CLIENTS_PER_ROUND = flags.DEFINE_integer(
  'clients_per_round', 10, 'Participants per round.'
)
_BATCH_SIZE = flags.DEFINE_integer('batch_size', 64, 'Scoring batch size.')
_TOP_K = flags.DEFINE_integer('top_k', 3, 'Blocks each client uploads.')
_EPSILON = flags.DEFINE_float('epsilon', 0.1, 'Exploration probability.')
_EPSILON_DECAY = flags.DEFINE_float(
  'epsilon_decay', 1.0, 'ε is multiplied by this per depth.'
)
_REWARD = flags.DEFINE_float('reward', 0.2, 'Weight reward factor.')
_PENALTY = flags.DEFINE_float('penalty', 0.2, 'Weight penalty factor.')
_THRESHOLD = flags.DEFINE_float('threshold', 0.75, 'Rank threshold.')
_AGGREGATION = flags.DEFINE_enum(
  'aggregation',
  'rl',
  CHOICES['aggregation'],
  'Vote aggregation: rl (reinforcement-learned client weights) or uniform '
  '(every client alike).',
)
_NUM_SELECTIONS = flags.DEFINE_integer(
  'num_selections', 3, 'Blocks chosen per network; networks kept.'
)
_ROUNDS_PER_SELECTION = flags.DEFINE_integer(
  'rounds_per_selection', 5, 'Rounds per block selection.'
)
_MAX_DEPTH = flags.DEFINE_integer('max_depth', 8, 'Most blocks per network.')
_PRUNE = flags.DEFINE_bool('prune', True, 'Search-space optimiser.')
_VIEW = flags.DEFINE_enum('view', 'positions', CHOICES['view'], 'CKA view.')
_DEBIASED = flags.DEFINE_bool('debiased', False, 'Debiased CKA.')
_SPATIAL = flags.DEFINE_enum(
  'spatial', 'match', CHOICES['spatial'], 'Stitching across spatial sizes.'
)
_STITCH_BIAS = flags.DEFINE_bool('stitch_bias', False, 'Affine stitches.')
_SOLVER = flags.DEFINE_enum(
  'stitch_solver', 'pinv', CHOICES['stitch_solver'], 'Stitch fit.'
)
_SEED = flags.DEFINE_integer('seed', 0, 'Seed.')
_EVAL = flags.DEFINE_enum(
  'eval', 'head', CHOICES['eval'], 'How networks are evaluated.'
)
_KNN_REFERENCE = flags.DEFINE_integer(
  'knn_reference', 2000, 'Public examples the kNN probe is fitted on.'
)
_KNN_AT = flags.DEFINE_enum(
  'knn_at',
  'output',
  ['output', 'trunk'],
  "What the kNN probe reads: the network's output (a finished network: "
  'its logits), or for a finished network the input of its end block '
  "(trunk): the features, when the pool's heads learnt other classes "
  '(--classes); its last block is still chosen by the search.',
)
_EVAL_EXAMPLES = flags.DEFINE_integer(
  'eval_examples', 0, 'Test examples to evaluate on (0: all).'
)
_LABEL_MAP = flags.DEFINE_string(
  'label_map',
  None,
  'Per dataset class, the pool classes that count as it: a JSON file (a '
  'list of lists of class ids) or a bundled map by name (cifar10, cinic10: '
  'ImageNet-1K to the CIFAR-10 classes; fedjax_mr.stitch.label_maps).',
)
_CLASSES = flags.DEFINE_string(
  'classes',
  '',
  "The clients' task: these classes only, e.g. 5-9 (relabelled 0..n-1); "
  'with a pool trained on other classes (pretrain_zoo --classes) a '
  'transfer setting, evaluated by --eval=knn. Empty: all.',
)
_LOCAL_CLIENTS = flags.DEFINE_integer(
  'local_clients', 0, '"Local" baseline: this many clients stitch alone.'
)
# fedjax_mr.energy.fleet.BACKENDS (a test checks they agree).
ENERGY_BACKENDS = ['simulated', 'dry_run', 'sysfs']
_ENERGY_BACKEND = flags.DEFINE_enum(
  'energy_backend',
  'simulated',
  ENERGY_BACKENDS,
  "Where the clients' local energy coordinators run: simulated devices "
  '(--energy_mix), or this Jetson through sysfs (--energy_profile; clocks '
  'are set per client, restored at the end), or a dry run of that (writes '
  'planned and recorded, none made).',
)
_ENERGY_MIX = flags.DEFINE_string(
  'energy_mix',
  'tx2_chained@1:0.3,tx2_chained@0.7:0.4,tx2_chained@0.4:0.3',
  'The simulated devices, profile[@speed]:weight,... (profiles: '
  'tx2_literal, tx2_chained or a JSON file; --energy_backend=simulated).',
)
_ENERGY_PROFILE = flags.DEFINE_string(
  'energy_profile',
  None,
  "This device's profile (tx2_literal, tx2_chained or a JSON file of "
  'experiments.profile_device) for --energy_backend=sysfs or dry_run.',
)
_ENERGY_SYSFS_ROOT = flags.DEFINE_string(
  'energy_sysfs_root',
  '/',
  'Root of the sysfs tree (--energy_backend=sysfs or dry_run).',
)
_ENERGY_MS_PER_SCORE = flags.DEFINE_float(
  'energy_ms_per_score',
  1.0,
  "The coordinators' time model: ms to score one candidate block on one "
  "example at the profile's first configuration (feedback corrects it; "
  'on simulated devices it is the time).',
)
_WORKDIR = flags.DEFINE_string('workdir', 'runs/stitch', 'Output folder.')


def _config(stitch, seed):
  return stitch.Config(
    clients_per_round=_CLIENTS_PER_ROUND.value,
    batch_size=_BATCH_SIZE.value,
    top_k=_TOP_K.value,
    epsilon=_EPSILON.value,
    epsilon_decay=_EPSILON_DECAY.value,
    reward=_REWARD.value,
    penalty=_PENALTY.value,
    threshold=_THRESHOLD.value,
    aggregation=_AGGREGATION.value,
    num_selections=_NUM_SELECTIONS.value,
    rounds_per_selection=_ROUNDS_PER_SELECTION.value,
    max_depth=_MAX_DEPTH.value,
    prune=_PRUNE.value,
    view=_VIEW.value,
    debiased=_DEBIASED.value,
    spatial=_SPATIAL.value,
    stitch_bias=_STITCH_BIAS.value,
    solver=_SOLVER.value,
    seed=seed,
  )


STATE_FILE = 'state.npz'
CLIENTS_FILE = 'client_indices.json'
# The flags that define a run's state (the others only change what is
# evaluated or reported); saved with the state, checked on resume.
_IDENTITY_FLAGS = (
  'cuts',
  'dataset',
  'num_clients',
  'partition',
  'alpha',
  'clients_per_round',
  'batch_size',
  'top_k',
  'epsilon',
  'epsilon_decay',
  'reward',
  'penalty',
  'threshold',
  'aggregation',
  'num_selections',
  'rounds_per_selection',
  'max_depth',
  'prune',
  'view',
  'debiased',
  'spatial',
  'stitch_bias',
  'stitch_solver',
  'seed',
  'energy_backend',
  'energy_mix',
  'energy_profile',
  'energy_ms_per_score',
)


def _identity(models) -> dict:
  """The flags that define the run, and the pool's models by id."""
  out = {name: flags.FLAGS[name].value for name in _IDENTITY_FLAGS}
  # Stored under the flag's earlier name: workdirs keep resuming.
  out['dirichlet_alpha'] = out.pop('alpha')
  out['pool_models'] = [m.id for m in models]
  if _PARTITION.value == 'shards':  # absent before: old workdirs resume
    out['shards_per_client'] = _SHARDS_PER_CLIENT.value
  if _CLASSES.value:  # absent before --classes: old workdirs resume
    out['classes'] = _CLASSES.value
  if _IMAGENET_POOL.value:
    out['imagenet_resolution'] = _IMAGENET_RESOLUTION.value
  return out


def _peak_mib() -> float:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('VmHWM:'):
        return int(line.split()[1]) / 1024
  return 0.0


def _print_round(state) -> None:
  e = state.log[-1]
  w = e['weights']
  print(
    f'round {e["round"]:3d}  depth {e["depth"]}  pool '
    f'{",".join(map(str, e["pool_sizes"]))}  selection '
    f'{sum(e["client_time_s"]):.2f} s  weights: effective '
    f'{w["effective_clients"]:.1f} clients, max {w["max"]:.2f}×, min '
    f'{w["min"]:.2f}×',
    flush=True,
  )
  en = e.get('energy')
  if en is not None:
    met = [c['met'] for c in en['clients']]
    print(
      f'    energy {en["energy_j"]:.1f} J (highest frequency '
      f'{en["default_energy_j"]:.1f} J); '
      + (
        'no deadline yet'
        if en['deadline_s'] is None
        else f'deadline {en["deadline_s"]:.2f} s, met by {sum(met)}/{len(met)}'
      )
      + '; configs '
      + ', '.join(c['config'] for c in en['clients']),
      flush=True,
    )
  for s in e.get('selected', []):
    if 'block' in s:
      print(
        f'    {s["network"]}  +  {s["block"]}  (votes {s["votes"]:.1f}, '
        f'CKA {s["mean_cka"]:.3f})',
        flush=True,
      )


_LOCKS = []


def main(argv) -> None:
  cli.no_arguments(argv)
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore
  from fedjax_mr import stitch
  from fedjax_mr.core import errors

  try:
    _main(stitch, errors)
  except errors.UserError as e:
    cli.fail(str(e))


def _check_flags(stitch, errors, network) -> None:
  """Refuses a bad flag value in one line, before anything is loaded."""
  import math

  from fedjax_mr.stitch import blocks
  from fedjax_mr.stitch import config as stitch_config

  n = _NUM_CLIENTS.value
  checks = [
    (n >= 1, f'--num_clients must be ≥ 1, got {n}'),
    (
      _CLIENTS_PER_ROUND.value <= n,
      f'--clients_per_round={_CLIENTS_PER_ROUND.value} exceeds '
      f'--num_clients={n}; it must be between 1 and num_clients',
    ),
    (
      0 <= _SEED.value < 2**32,
      f'--seed must be in [0, 2**32), got {_SEED.value}',
    ),
    (
      _EVAL_EXAMPLES.value >= 0,
      f'--eval_examples must be ≥ 0 (0: all), got {_EVAL_EXAMPLES.value}',
    ),
    (
      _KNN_REFERENCE.value >= 1,
      f'--knn_reference must be ≥ 1, got {_KNN_REFERENCE.value}',
    ),
    (
      0 <= _LOCAL_CLIENTS.value <= n,
      f'--local_clients must be in [0, --num_clients={n}], got '
      f'{_LOCAL_CLIENTS.value}',
    ),
    (
      _EVAL.value in network.EVAL_MODES,
      f'--eval must be one of {", ".join(network.EVAL_MODES)}',
    ),
    (
      _CUTS.value in blocks.CUT_STYLES,
      f'--cuts must be one of {", ".join(blocks.CUT_STYLES)}',
    ),
  ]
  alpha = _ALPHA.value
  if _PARTITION.value in ('dirichlet', 'dirichlet_equal'):
    checks.append(
      (
        alpha > 0 and math.isfinite(alpha),
        f'--alpha must be finite and > 0, got {alpha}',
      )
    )
  else:
    checks.append(
      (
        flags.FLAGS['alpha'].using_default_value,
        f'--alpha applies to --partition=dirichlet|dirichlet_equal only, not '
        f'--partition={_PARTITION.value}',
      )
    )
  if _PARTITION.value == 'shards':
    checks.append(
      (
        _SHARDS_PER_CLIENT.value >= 1,
        f'--shards_per_client must be >= 1, got {_SHARDS_PER_CLIENT.value}',
      )
    )
  else:
    checks.append(
      (
        flags.FLAGS['shards_per_client'].using_default_value,
        '--shards_per_client applies to --partition=shards only, not '
        f'--partition={_PARTITION.value}',
      )
    )
  for name in ('epsilon', 'epsilon_decay', 'reward', 'penalty', 'threshold'):
    value = flags.FLAGS[name].value
    checks.append(
      (math.isfinite(value), f'--{name} must be finite, got {value}')
    )
  ms = _ENERGY_MS_PER_SCORE.value
  checks.append(
    (
      ms > 0 and math.isfinite(ms),
      f'--energy_ms_per_score must be finite and > 0, got {ms}',
    )
  )
  backend = _ENERGY_BACKEND.value
  if backend == 'simulated':
    checks.append(
      (
        _ENERGY_PROFILE.value is None,
        '--energy_profile applies to --energy_backend=sysfs or dry_run, '
        'not simulated (which takes --energy_mix)',
      )
    )
  else:
    checks += [
      (
        flags.FLAGS['energy_mix'].using_default_value,
        f'--energy_mix applies to --energy_backend=simulated, not {backend} '
        '(which takes --energy_profile)',
      ),
      (
        _ENERGY_PROFILE.value is not None,
        f'--energy_backend={backend} needs --energy_profile: tx2_literal, '
        'tx2_chained or a JSON file of experiments.profile_device',
      ),
    ]
  for ok, message in checks:
    if not ok:
      raise errors.ConfigError(message)
  stitch_config.check_config(
    _config(stitch, _SEED.value), n, names={'solver': 'stitch_solver'}
  )


def _fleet(errors):
  """The clients' energy coordinators of --energy_backend; a bad setting
  is refused in one line before the data loads, and nothing is written."""
  from fedjax_mr import energy
  from fedjax_mr.energy import fleet
  from fedjax_mr.energy import simulation

  seconds = _ENERGY_MS_PER_SCORE.value / 1000
  if _ENERGY_BACKEND.value == 'simulated':
    try:
      devices = simulation.assign_profiles(
        _ENERGY_MIX.value, _NUM_CLIENTS.value, _SEED.value
      )
    except (ValueError, OSError) as e:
      raise errors.ConfigError(
        f'--energy_mix={_ENERGY_MIX.value!r}: {e}'
      ) from None
    return fleet.Fleet(
      fleet.SimulatedBackend(devices), seconds_per_unit=seconds
    )
  where = f'--energy_sysfs_root={_ENERGY_SYSFS_ROOT.value}'
  root = energy.SysfsRoot(_ENERGY_SYSFS_ROOT.value)
  if not root.is_dir('.'):
    raise errors.ConfigError(f'{where}: no such directory')
  try:
    profile = energy.get_profile(_ENERGY_PROFILE.value)
  except (ValueError, OSError, TypeError, KeyError) as e:
    raise errors.ConfigError(
      f'--energy_profile={_ENERGY_PROFILE.value}: {e}'
    ) from None
  try:
    info = energy.discover(root)
    meter = energy.SysfsPowerMeter(root, info.power_channels)
    plan = energy.SysfsDvfs(root, info, dry_run=True)
    for config in profile.configs:  # Each must fit this device.
      plan.apply(config)
  except energy.EnergyError as e:
    raise errors.ConfigError(
      f'{where} with --energy_profile={_ENERGY_PROFILE.value}: {e}'
    ) from None
  if _ENERGY_BACKEND.value == 'sysfs':
    for rel, _ in plan.writes:
      if not os.access(root.path(rel), os.W_OK):
        raise errors.ConfigError(
          f'--energy_backend=sysfs may not write {root.path(rel)}: '
          'changing clocks needs root (run with sudo), or use '
          '--energy_backend=dry_run'
        )
  dvfs = energy.SysfsDvfs(
    root, info, dry_run=_ENERGY_BACKEND.value == 'dry_run'
  )
  return fleet.Fleet(
    fleet.SysfsBackend(dvfs, profile, meter.total_w),
    seconds_per_unit=seconds,
  )


def _read_label_map(errors, classes=None) -> list | None:
  """The map of --label_map (a bundled map's name or a JSON file), the
  dataset's bundled map under --imagenet_pool without one, else None. A
  bundled map covers all the dataset's classes: with --classes, the
  entries of those classes."""
  from fedjax_mr.stitch import label_maps

  named = None
  if _LABEL_MAP.value:
    named = label_maps.bundled(_LABEL_MAP.value)
  elif _IMAGENET_POOL.value:
    named = label_maps.bundled(_DATASET.value)
  if named is not None:
    return named if classes is None else [named[c] for c in classes]
  if not _LABEL_MAP.value:
    return None
  try:
    with open(_LABEL_MAP.value) as f:
      label_map = json.load(f)
  except (OSError, ValueError) as e:
    reason = e.strerror if isinstance(e, OSError) else f'not JSON ({e})'
    raise errors.ConfigError(
      f'--label_map={_LABEL_MAP.value}: cannot read it: {reason} (bundled '
      f'maps: {", ".join(sorted(label_maps.BUNDLED))})'
    ) from None
  if not isinstance(label_map, list):
    raise errors.ConfigError(
      f'--label_map={_LABEL_MAP.value}: must hold a JSON list'
    )
  return label_map


def _main(stitch, errors) -> None:
  import jax.numpy as jnp
  import numpy as np

  from fedjax_mr.core import files
  from fedjax_mr.core import workdir as workdir_lib
  from fedjax_mr.data import datasets
  from fedjax_mr.data import partition
  from fedjax_mr.stitch import network
  from fedjax_mr.stitch import pool as pool_lib
  from fedjax_mr.stitch import state as state_lib

  _check_flags(stitch, errors, network)
  _read_label_map(errors)  # a bad file is refused before the data loads
  coordinators = _fleet(errors)
  workdir_lib.check_free(_WORKDIR.value)
  old_state = os.path.join(_WORKDIR.value, 'state.pkl')
  if os.path.exists(old_state):
    raise errors.ConfigError(
      f'--workdir: {old_state} is a state saved as a pickle by an older '
      'version; fedjax_mr never unpickles, so it cannot resume it: pass '
      'another --workdir (or remove that file to start over)'
    )
  ds = datasets.load(_DATASET.value, _DATA_DIR.value)
  classes = None
  if _CLASSES.value:
    classes = datasets.parse_classes(_CLASSES.value, ds.num_classes)
    ds = datasets.select_classes(ds, classes)
  if _IMAGENET_POOL.value:
    from fedjax_mr.stitch import torchvision_import

    models = torchvision_import.load_pool(
      _IMAGENET_POOL.value,
      input_shape=ds.input_shape,
      scale=ds.scale,
      shift=ds.shift,
      resolution=_IMAGENET_RESOLUTION.value,
      ids=_POOL_MODELS.value or None,
    )
  else:
    models = pool_lib.load(_POOL.value, _POOL_MODELS.value or None)
  for m in models:
    if tuple(m.model.input_shape) != ds.input_shape:
      raise errors.ConfigError(
        f'--pool: model {m.id} takes {m.model.input_shape}, --dataset='
        f'{ds.name} has examples of shape {ds.input_shape}'
      )
  if _EVAL.value != 'knn':
    for m in models:
      pool_classes = m.meta.get('classes')
      if pool_classes is not None and list(pool_classes) != list(
        classes or range(ds.num_classes)
      ):
        raise errors.ConfigError(
          f'--eval={_EVAL.value}: pool model {m.id} was trained on classes '
          f"{pool_classes}, the clients' task (--classes) is "
          f'{list(classes or range(ds.num_classes))}: its head cannot '
          'answer it; use --eval=knn'
        )
  label_map = _read_label_map(errors, classes)
  if label_map is not None and _IMAGENET_POOL.value:
    label_map = torchvision_import.check_label_map(
      label_map, ds.num_classes, min(m.model.num_classes for m in models)
    )
  if label_map is not None:
    if len(label_map) != ds.num_classes:
      raise errors.ConfigError(
        f'--label_map: {len(label_map)} entries, --dataset has '
        f'{ds.num_classes} classes'
      )
  elif _EVAL.value != 'knn' and any(
    m.model.num_classes != ds.num_classes for m in models
  ):
    from fedjax_mr.stitch import label_maps

    raise errors.ConfigError(
      '--label_map is needed: pool models have other label spaces than '
      f'--dataset={ds.name} (bundled maps: '
      f'{", ".join(sorted(label_maps.BUNDLED))})'
    )
  split = None
  if not _IMAGENET_POOL.value:
    split = pool_lib.public_indices(_POOL.value)
  if split is not None and split.get('dataset') == ds.name:
    public = np.asarray(split['indices'], int)
  else:
    public = np.zeros((0,), int)
  private = np.setdiff1d(np.arange(len(ds.y_train)), public)
  private = private[ds.y_train[private] >= 0]  # --classes
  public = public[ds.y_train[public] >= 0]
  if _PARTITION.value == 'iid':
    parts = partition.iid(len(private), _NUM_CLIENTS.value, _SEED.value)
  elif _PARTITION.value == 'shards':
    parts = partition.shards(
      ds.y_train[private],
      _NUM_CLIENTS.value,
      _SHARDS_PER_CLIENT.value,
      _SEED.value,
    )
  elif _PARTITION.value == 'dirichlet_equal':
    parts = partition.dirichlet_equal(
      ds.y_train[private], _NUM_CLIENTS.value, _ALPHA.value, _SEED.value
    )
  else:
    parts = partition.dirichlet(
      ds.y_train[private], _NUM_CLIENTS.value, _ALPHA.value, _SEED.value
    )
  parts = [private[p] for p in parts]
  chains = pool_lib.chains(models, _CUTS.value)
  pool = stitch.make_pool(chains)
  print(
    f'pool: {len(pool.blocks)} blocks from {len(models)} models '
    f'({", ".join(f"{m.id}: {len(c)}" for m, c in zip(models, chains))}); '
    f'{_NUM_CLIENTS.value} clients, {_PARTITION.value}'
    + (f' α={_ALPHA.value}' if 'dirichlet' in _PARTITION.value else ''),
    flush=True,
  )
  b = _BATCH_SIZE.value

  def batch_fn(c, r):
    rng = np.random.default_rng([_SEED.value, c, r, 7])
    idx = parts[c]
    pick = rng.choice(len(idx), b, replace=len(idx) < b)
    xb = ds.x_train[np.sort(idx[pick])]
    return jnp.asarray(xb).astype(jnp.float32) * ds.scale + ds.shift

  n_eval = _EVAL_EXAMPLES.value or len(ds.y_test)
  x_test, y_test = ds.x_test[:n_eval], ds.y_test[:n_eval]
  ref = public[: _KNN_REFERENCE.value] if len(public) else parts[0]
  x_ref, y_ref = ds.x_train[ref], ds.y_train[ref]

  def evaluate(net):
    knn = _EVAL.value != 'head'
    trunk = knn and _KNN_AT.value == 'trunk' and net.finished
    acc = network.accuracies(
      net,
      x_test,
      y_test,
      scale=ds.scale,
      shift=ds.shift,
      head=_EVAL.value in ('head', 'both'),
      knn_reference=(x_ref, y_ref) if knn and not trunk else None,
      label_map=label_map,
    )
    if trunk:  # the features its end block starts from
      acc.update(
        network.accuracies(
          network.Network(net.blocks[:-1], net.stitches[:-1]),
          x_test,
          y_test,
          scale=ds.scale,
          shift=ds.shift,
          head=False,
          knn_reference=(x_ref, y_ref),
        )
      )
    return acc

  # Held until the process ends: one writer per workdir.
  _LOCKS.append(workdir_lib.acquire(_WORKDIR.value))
  # The clients' training examples, for `experiments.run
  # --partition=file`: the training baselines learn from the same clients.
  partition.save_file(os.path.join(_WORKDIR.value, CLIENTS_FILE), parts)
  # Per client: size and examples per class (experiments.run's summary).
  partition.save_summary(
    os.path.join(_WORKDIR.value, 'partition.json'),
    partition.summary(parts, ds.y_train, ds.num_classes),
  )
  config = _config(stitch, _SEED.value)
  from fedjax_mr.energy import sysfs

  try:
    state = stitch.run(
      pool,
      batch_fn,
      _NUM_CLIENTS.value,
      config,
      state_path=os.path.join(_WORKDIR.value, STATE_FILE),
      identity=_identity(models),
      on_round=_print_round,
      energy=coordinators,
    )
  except sysfs.EnergyError as e:  # e.g. the kernel refused a clock
    raise errors.UserError(f'--energy_backend={_ENERGY_BACKEND.value}: {e}')
  # Over every round of the run, also those before a resume.
  run_seconds = sum(e.get('round_time_s', 0.0) for e in state.log)
  files.write_atomic(
    os.path.join(_WORKDIR.value, 'log.jsonl'),
    lambda f: f.writelines(
      json.dumps({k: v for k, v in e.items() if k != 'energy'}) + '\n'
      for e in state.log
    ),
  )
  files.write_atomic(
    os.path.join(_WORKDIR.value, 'energy.jsonl'),
    lambda f: f.writelines(
      json.dumps({'round': e['round'], **e['energy']}) + '\n' for e in state.log
    ),
  )

  key = 'head' if _EVAL.value in ('head', 'both') else 'knn'
  nets = []
  for fin in state.finished:
    acc = evaluate(fin.net)
    nets.append(
      {
        'path': fin.net.describe(),
        'depth': fin.net.depth,
        'round': fin.round,
        'share': fin.share,
        **acc,
      }
    )
    print(
      f'{fin.net.describe()}: '
      + ', '.join(f'{k} {100 * v:.2f} %' for k, v in acc.items()),
      flush=True,
    )
  nets.sort(key=lambda n: -n[key])
  state_lib.write_document(
    os.path.join(_WORKDIR.value, 'networks.npz'),
    state_lib.to_host(state)['finished'],
    _identity(models),
  )

  pool_acc = {
    # A pool model is its own blocks, with nothing between them.
    m.id: evaluate(network.Network(tuple(chain), (None,) * len(chain)))
    for m, chain in zip(models, chains)
  }

  local = None
  if _LOCAL_CLIENTS.value > 0:
    rng = np.random.default_rng([_SEED.value, 99])
    who = sorted(
      int(c)
      for c in rng.choice(
        _NUM_CLIENTS.value, _LOCAL_CLIENTS.value, replace=False
      )
    )
    local_cfg = config._replace(clients_per_round=1)
    local = {'clients': who, 'best': []}
    for c in who:
      st = stitch.run(
        pool, batch_fn, _NUM_CLIENTS.value, local_cfg, population=[c]
      )
      accs = [evaluate(f.net)[key] for f in st.finished]
      best = max(accs) if accs else float('nan')
      local['best'].append(best)
      print(
        f'Local (client {c} alone): best {100 * best:.2f} % of '
        f'{len(accs)} networks',
        flush=True,
      )
    local['mean_best'] = float(np.nanmean(local['best']))

  from fedjax_mr.energy import fleet

  rounds = state.log
  energy_summary = {
    'backend': _ENERGY_BACKEND.value,
    'devices': (
      _ENERGY_MIX.value
      if _ENERGY_BACKEND.value == 'simulated'
      else _ENERGY_PROFILE.value
    ),
    **fleet.summarize([e['energy'] for e in rounds]),
  }
  results = {
    'config': config._asdict(),
    'partition': _PARTITION.value,
    'dirichlet_alpha': _ALPHA.value,
    'eval': _EVAL.value,
    'knn_at': _KNN_AT.value,
    'pool_blocks': len(pool.blocks),
    'pool_models': pool_acc,
    'networks': nets,
    'best': nets[0] if nets else None,
    'local': local,
    'rounds': len(rounds),
    'run_seconds': run_seconds,
    'selection_seconds_per_round': [sum(e['client_time_s']) for e in rounds],
    'pool_sizes': [e['pool_sizes'] for e in rounds],
    'selection_seconds_total': float(
      sum(sum(e['client_time_s']) for e in rounds)
    ),
    'final_weights': rounds[-1]['weights'] if rounds else None,
    'energy': energy_summary,
    'peak_host_mib': _peak_mib(),
  }
  files.write_atomic(
    os.path.join(_WORKDIR.value, 'results.json'),
    lambda f: json.dump(results, f, indent=1, default=_plain),
  )
  print(
    f'{len(nets)} stitched networks in {len(rounds)} rounds '
    f'({run_seconds:.0f} s; client selection time '
    f'{results["selection_seconds_total"]:.1f} s); best: '
    + (f'{nets[0]["path"]} {100 * nets[0][key]:.2f} %' if nets else 'none')
  )
  for m, acc in pool_acc.items():
    print(f'pool model {m} alone: {100 * acc[key]:.2f} %')
  if local:
    print(
      f"Local (mean of {len(local['clients'])} clients' best): "
      f'{100 * local["mean_best"]:.2f} %'
    )
  en = energy_summary
  writes = sum(
    len(c.get('writes', ())) for r in rounds for c in r['energy']['clients']
  )
  print(
    f'energy ({en["backend"]}, {en["devices"]}): local coordinators '
    f'{en["coordinated_energy_j"]:.1f} J vs {en["default_energy_j"]:.1f} J '
    f'at the highest frequency, saving {100 * en["energy_saving"]:.1f} % '
    f'(time {100 * en["time_change"]:+.1f} %, {en["missed"]} missed deadlines'
    + (
      ''
      if en['backend'] == 'simulated'
      else f'; {writes} sysfs writes'
      + (', planned only' if en['backend'] == 'dry_run' else '')
    )
    + '); per client and round in energy.jsonl'
  )
  print(f'peak host memory {results["peak_host_mib"]:.0f} MiB')


def _plain(o):
  """JSON for numpy scalars and arrays."""
  import numpy as np

  if isinstance(o, (np.generic, np.ndarray)):
    return o.tolist()
  raise TypeError(f'{type(o).__name__} is not JSON serializable')


def entry() -> None:
  """The console script `fedjax-mr-stitch`."""
  cli.run(main)


if __name__ == '__main__':
  entry()
