"""The transfer setting's kNN probe, applied to a training run's models.

In FedStitch's transfer setting (a pool pre-trained on other classes)
experiments.stitch reads its stitched networks, its Local baseline and the
pool models by a 5-NN probe (`eval=knn`, `knn_at=trunk`): a k-nearest-
neighbour classifier fitted on the features of the first `knn_reference`
public examples of the clients' classes and applied to the features of
the test images. `probe` gives a finished experiments.run workdir (a
training baseline) the same read-out, beside its own head: for every
checkpoint it kept, the global model is restored (checked against its
digest), cut into blocks exactly as a pool model is (`blocks.split`), and
the same probe (`network.accuracies`) reads the output of every block but
the end one, on the same reference and test examples
(`stitch_experiment.public_examples`, `evaluation.knn_examples`,
`evaluation.test_examples`).

The trunk, so, is the input of a network's end block, its classifier
unit: for the small CNNs the flattened output of the last convolution
block (the end block holds every dense layer), for the ResNets the last
stage's feature map before the global average pool (for `resnet18_w16` on
28 × 28 images 4 × 4 × 128 = 2,048 features). The multi-exit ResNet-18 of
DepthFL is read through its deepest exit: its trunk is the same map, the
input of exit 4 (each exit is a global average pool and a dense layer);
a DepthFL model around another zoo model is read as that model.

References:
  "Heterogeneity-Aware Coordination for Federated Learning via Stitching
  Pre-trained blocks" (FedStitch), 2024, §V; Teerapittayanon et al.,
  "StitchNet", 2023, §4 (the kNN evaluation).
"""

from __future__ import annotations

import os
from typing import Any
from typing import Callable
from typing import NamedTuple

import jax
import numpy as np

from fedjax_mr.analysis import stitch_tables
from fedjax_mr.core import errors
from fedjax_mr.core import types
from fedjax_mr.core import workdir as workdir_lib
from fedjax_mr.models import model as model_lib
from fedjax_mr.models import multi_exit
from fedjax_mr.pipeline import build
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import evaluation
from fedjax_mr.pipeline import experiment
from fedjax_mr.pipeline import stitch_config
from fedjax_mr.pipeline import stitch_experiment
from fedjax_mr.runtime import checkpoint
from fedjax_mr.runtime import distributed
from fedjax_mr.runtime import metrics_io
from fedjax_mr.runtime import provenance
from fedjax_mr.stitch import blocks
from fedjax_mr.stitch import network

# What `probe` writes into the run's workdir (named where the tables,
# host-only, read it).
PROBE_FILE = stitch_tables.PROBE_FILE
# The stitch probe's neighbours (`network.accuracies`' default) and
# reference size (experiments.stitch's `knn_reference` default).
K = 5
KNN_REFERENCE = stitch_config.Evaluation().knn_reference
# How the README's transfer runs cut the pool. Only the end block matters
# here, and it is the whole classifier under 'default' cuts as well.
CUTS = 'every_unit'
_ONE_STAGE = '+one_stage'
_MULTI_EXIT = 'resnet18_multi_exit'

Log = Callable[[str], None]


def zoo_view(
  model: model_lib.Model, variables: types.Variables
) -> tuple[str, types.Variables]:
  """`(zoo name, variables)` of the zoo network whose blocks are
  `model`'s up to its end block: `model` itself; DepthFL's multi-exit
  ResNet-18 as the zoo ResNet-18 with its deepest exit as the classifier;
  a one-stage wrapper as the model inside it."""
  if model.name.endswith(_ONE_STAGE):
    inner = {c: tree['inner'] for c, tree in variables.items()}
    return model.name[: -len(_ONE_STAGE)], inner
  if model.name == _MULTI_EXIT:
    last = f'exit{multi_exit.num_exits(model.module)}'
    out = {}
    for c, tree in variables.items():
      out[c] = {k: v for k, v in tree.items() if not k.startswith('exit')}
      if last in tree:
        out[c]['linear'] = tree[last]
    return 'resnet18', out
  return model.name, variables


def trunk(
  model: model_lib.Model,
  variables: types.Variables,
  cuts: str = CUTS,
) -> network.Network:
  """`model` (with `variables`) up to its end block, cut into blocks as a
  pool model is: the network whose output the stitch probe reads.

  Raises:
    ConfigError: a model that cannot be cut into blocks (`units.NAMES`).
  """
  name, variables = zoo_view(model, jax.device_get(variables))
  chain = blocks.split('model', name, variables, model.input_shape, cuts)
  return network.trunk(network.Network(chain, (None,) * len(chain)))


class ProbeData(NamedTuple):
  """The stitch probe's examples (stored, model input `x * scale + shift`).

  Attributes:
    x_ref: `[M, ...]` the reference examples the kNN is fitted on.
    y_ref: `[M]` their labels.
    x_test: `[N, ...]` the test examples.
    y_test: `[N]` their labels.
    scale: see above.
    shift: see above.
  """

  x_ref: np.ndarray
  y_ref: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  scale: float
  shift: float


def probe_data(
  config: config_lib.ExperimentConfig, pool: str, knn_reference: int
) -> ProbeData:
  """The reference and test examples experiments.stitch's probe reads for
  the run's dataset and `classes` with `pool` (its public split).

  Raises:
    ConfigError: `pool` has no public examples of the run's dataset.
  """
  data = stitch_config.Data(
    dataset=config.data.dataset,
    data_dir=config.data.data_dir or None,
    classes=config.data.classes,
  )
  ds, _ = stitch_experiment.load_dataset(data)
  public, _ = stitch_experiment.public_examples(stitch_config.Pool(pool), ds)
  if not len(public):
    raise errors.ConfigError(
      f'`pool={pool}`: its public split (public.json) holds no examples of '
      f"the run's task (`dataset={config.data.dataset}`"
      + (f', `classes={config.data.classes}`' if config.data.classes else '')
      + '): the probe is fitted on them'
    )
  settings = stitch_config.Evaluation(knn_reference=knn_reference)
  x_ref, y_ref = evaluation.knn_examples(settings, ds, public, [])
  x_test, y_test = evaluation.test_examples(settings, ds)
  return ProbeData(x_ref, y_ref, x_test, y_test, ds.scale, ds.shift)


def pool_of(config: config_lib.ExperimentConfig, pool: str) -> str:
  """`pool`, else the pool folder of the run's `init_from` model; checked
  to hold a public split.

  Raises:
    ConfigError: none given and none to infer, or no public.json there.
  """
  if not pool and config.model.init_from:
    pool = os.path.dirname(os.path.normpath(config.model.init_from))
  if not pool:
    raise errors.ConfigError(
      '`pool` is needed: the run did not start from a pool model '
      "(`init_from`), and the probe is fitted on the pool's public examples"
    )
  if not os.path.isfile(os.path.join(pool, 'public.json')):
    raise errors.ConfigError(
      f'`pool={pool}`: no public.json there (a pool of '
      'experiments.pretrain_zoo holds its public split)'
    )
  return pool


def kept_rounds(workdir: str, config: config_lib.ExperimentConfig) -> list:
  """The rounds of the checkpoints a finished run kept, oldest first.

  Raises:
    ConfigError: no checkpoints, or the newest is not of the last round.
  """
  where = f'`workdir={workdir}`'
  if not os.path.isdir(os.path.join(workdir, checkpoint.FOLDER)):
    raise errors.ConfigError(f'{where}: no checkpoints, not a finished run')
  ckpt = checkpoint.Checkpointer(workdir, keep=config.run.keep_checkpoints)
  try:
    rounds = ckpt.all_rounds()
  finally:
    ckpt.close()
  if not rounds or rounds[-1] != config.run.rounds:
    newest = f'round {rounds[-1]}' if rounds else 'none'
    raise errors.ConfigError(
      f'{where} is not a finished run: its newest checkpoint is {newest} '
      f'of {config.run.rounds} rounds'
    )
  return rounds


ExitReader = Callable[[types.Variables, ProbeData], list]


def exit_reader(
  model: model_lib.Model, batch_size: int = 500
) -> ExitReader | None:
  """For DepthFL's multi-exit ResNet-18, a function of `(variables, data)`
  giving each exit's own test accuracy on `data`'s test examples,
  shallowest exit first (the model's head averages their logits); None
  for a model with one classifier. Compiled once for every round read."""
  if model.name != _MULTI_EXIT:
    return None
  apply = jax.jit(
    lambda v, x: model.module.apply(v, x, train=False, all_exits=True)
  )

  def read(variables: types.Variables, data: ProbeData) -> list:
    variables = jax.device_get(variables)
    correct = 0
    for start in range(0, len(data.y_test), batch_size):
      stop = start + batch_size
      x = data.x_test[start:stop].astype(np.float32)
      logits = np.asarray(apply(variables, x * data.scale + data.shift))
      hits = logits.argmax(-1) == np.asarray(data.y_test[start:stop])[:, None]
      correct = correct + hits.sum(0)
    return [float(c) / len(data.y_test) for c in correct]

  return read


def probe_round(
  exp: build.Experiment,
  workdir: str,
  round_index: int,
  data: ProbeData,
  exits: ExitReader | None = None,
) -> dict[str, Any]:
  """`{'round', 'knn', 'head', 'features', 'exits'}` of one kept
  checkpoint: the probe's accuracy, the head's recorded test accuracy
  (None if not evaluated that round), the trunk's feature width, and
  `exits(variables, data)` (None without `exits`)."""
  run = experiment.restore_run(workdir, exp, round_index)
  variables = types.evaluated_model(exp.algorithm, run.state.server)
  net = trunk(exp.model, variables)
  acc = network.accuracies(
    net,
    data.x_test,
    data.y_test,
    scale=data.scale,
    shift=data.shift,
    head=False,
    knn_reference=(data.x_ref, data.y_ref),
    k=K,
  )['knn']
  row = next((r for r in run.history if r['round'] == round_index), {})
  return {
    'round': round_index,
    'knn': acc,
    'head': row.get('test_accuracy'),
    'features': int(np.prod(net.out_spec)),
    'exits': None if exits is None else exits(variables, data),
  }


def check_args(workdir: str, knn_reference: int) -> None:
  """The arguments that need no file read."""
  if not workdir:
    raise errors.ConfigError('`workdir`: the finished run to probe is required')
  if knn_reference < 1:
    raise errors.ConfigError(
      f'`knn_reference` must be ≥ 1, got {knn_reference}'
    )
  if not os.path.isdir(workdir):
    what = 'not a folder' if os.path.exists(workdir) else 'no such folder'
    raise errors.ConfigError(f'`workdir={workdir}`: {what}')


def probe(
  workdir: str,
  pool: str = '',
  knn_reference: int = KNN_REFERENCE,
  log: Log = print,
) -> dict[str, Any]:
  """Probes every checkpoint a finished experiments.run workdir kept and
  writes `<workdir>/probe.json` (after every input is checked and every
  round probed).

  Args:
    workdir: the finished run.
    pool: the pool folder whose public split the probe is fitted on
      (default: the one of the run's `init_from` model).
    knn_reference: how many public examples (the first ones).
    log: where the per-round lines go.

  Returns:
    What probe.json holds.

  Raises:
    UserError: a bad argument, a workdir that is not a finished run or is
      in use, a checkpoint that does not restore intact.
  """
  check_args(workdir, knn_reference)
  config = experiment.read_config(workdir)
  # The run's devices, before anything below starts JAX's.
  distributed.initialize_for(config.devices, config.server.clients_per_round)
  workdir_lib.check_free(workdir)
  rounds = kept_rounds(workdir, config)
  pool = pool_of(config, pool)
  data = probe_data(config, pool, knn_reference)
  exp = experiment.setup(config)
  exits = exit_reader(exp.model)
  rows = []
  for r in rounds:
    rows.append(probe_round(exp, workdir, r, data, exits))
    log(round_line(rows[-1]))
  record = make_record(workdir, config, pool, data, knn_reference, rows)
  with workdir_lib.acquire(workdir):
    metrics_io.write_json(os.path.join(workdir, PROBE_FILE), record, indent=1)
  return record


def round_line(row: dict[str, Any]) -> str:
  head = row['head']
  return (
    f'round {row["round"]}: {K}-NN on the trunk ({row["features"]:,} '
    f'features) {100 * row["knn"]:.2f} %'
    + ('' if head is None else f', own head {100 * head:.2f} %')
    + exits_text(row['exits'])
  )


def exits_text(exits: list | None) -> str:
  """', exits a/b/c/d %' (each exit alone, shallowest first), or ''."""
  if exits is None:
    return ''
  return ', exits ' + '/'.join(f'{100 * a:.2f}' for a in exits) + ' %'


def make_record(
  workdir: str,
  config: config_lib.ExperimentConfig,
  pool: str,
  data: ProbeData,
  knn_reference: int,
  rows: list[dict[str, Any]],
) -> dict[str, Any]:
  """What probe.json holds."""
  heads = [r['head'] for r in rows if r['head'] is not None]
  exits = [r['exits'] for r in rows]
  multi = exits[0] is not None
  return {
    'workdir': os.path.abspath(workdir),
    'algorithm': config.algorithm.name,
    'model': config.model.name,
    'dataset': config.data.dataset,
    'classes': config.data.classes,
    'pool': os.path.abspath(pool),
    'k': K,
    'knn_reference': knn_reference,
    'reference_size': len(data.y_ref),
    'test_examples': len(data.y_test),
    'trunk': 'the input of the end block (cuts=' + CUTS + ')',
    'features': rows[0]['features'],
    'rounds': [r['round'] for r in rows],
    'accuracy': [r['knn'] for r in rows],
    'head_accuracy': [r['head'] for r in rows],
    'mean': float(np.mean([r['knn'] for r in rows])),
    'head_mean': float(np.mean(heads)) if heads else None,
    # A multi-exit model's exits read alone, per round and their means
    # over the rounds, shallowest exit first (None: one classifier).
    'exit_accuracy': exits if multi else None,
    'exit_mean': np.mean(exits, axis=0).tolist() if multi else None,
    'source': provenance.source_commit(),
  }
