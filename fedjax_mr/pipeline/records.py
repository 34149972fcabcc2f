"""What a run writes in its workdir, and how each round's rows are made.

`config.json` holds the config and one provenance record per process that
ran or resumed the run; `partition.json` the partition's summary. Each
round adds one row to `metrics.jsonl` (train loss, examples, steps, the
algorithm's metrics, the sampled client ids, evaluations and times) and
one to `clients.jsonl` (each sampled client's id, examples, local steps
and loss, null where not a number: a secure round's, a diverged one's;
and the K local models' accuracies when evaluated), and the metrics row
to the TensorBoard events. `Records` writes each round's rows once (also
when an interrupt lands between them); a resumed run first
drops the rows past its checkpoint, and a row that does not read (or rows
that end before the newest checkpoint) makes it resume from a checkpoint
before that row (`intact_rounds`), so that every row is recomputed rather
than lost; so does a metrics row that names other clients than the
clients row of its round. config.json also holds the fingerprint of the
data the run loaded (`DATA_KEY`). Each checkpoint keeps the digest of the
rows written up to its round (`ROWS_KEY`, `chain`): a resumed run checks
that the records still hold them.

`setting_title` is how a comparison, a run's curves.png and a landscape
title the run's setting; `rounds` counts rounds in words.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any
from typing import Callable
from typing import Mapping
from typing import Sequence

import numpy as np

from fedjax_mr.core import jsonfile
from fedjax_mr.data import datasets
from fedjax_mr.data import partition as partition_lib
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import registry
from fedjax_mr.runtime import metrics_io
from fedjax_mr.runtime import plots
from fedjax_mr.runtime import provenance
from fedjax_mr.runtime import tensorboard
from fedjax_mr.training import engine

METRICS_FILE = 'metrics.jsonl'
# Per round: each sampled client's id, examples, local steps and training
# loss, and the K local models' test accuracies when evaluated.
CLIENTS_FILE = 'clients.jsonl'
CONFIG_FILE = 'config.json'
# config.json's list of provenance records (see `provenance.collect`).
PROVENANCE_KEY = 'provenance'
PARTITION_FILE = 'partition.json'
# config.json's fingerprint of the data loaded (`build.data_fingerprint`).
DATA_KEY = 'data'
CURVE_FILE = 'learning_curve.png'
# The files a run writes in its workdir (besides the folders below and the
# lock): none may be a symbolic link (`workdir.check_entries`).
OWN_FILES = (
  CONFIG_FILE,
  PARTITION_FILE,
  METRICS_FILE,
  CLIENTS_FILE,
  CURVE_FILE,
)
# The metrics row's fields that are this process's times, not results:
# left out of the rows' digest, which every process computes alike.
TIME_KEYS = frozenset({'round_time_s', 'eval_time_s', 'elapsed_s'})
# A checkpoint's metadata key: the digest of the rows up to its round.
ROWS_KEY = 'rows'
# The rows' digest before round 1.
NO_ROWS = hashlib.sha256(b'fedjax_mr rows').hexdigest()


def chain(
  previous: str, row: Mapping[str, Any], clients_row: Mapping[str, Any]
) -> str:
  """The digest of a run's rows after round `row['round']`: the sha256 of
  the digest `previous` (of the rows before it; `NO_ROWS` before round 1),
  the round's metrics row without its times and its clients row, as sorted
  JSON (a row read back dumps to the same text)."""
  h = hashlib.sha256(previous.encode())
  kept = {k: v for k, v in row.items() if k not in TIME_KEYS}
  h.update(json.dumps(kept, sort_keys=True).encode())
  h.update(json.dumps(clients_row, sort_keys=True).encode())
  return h.hexdigest()


def _rows(path: str) -> list[dict[str, Any] | None]:
  """Each line of a records file as a row, or None where it does not read
  (blank lines left out); [] when there is no file."""
  if not os.path.exists(path):
    return []
  with open(path, 'rb') as f:
    return [
      metrics_io.parse(raw)
      for raw in metrics_io.lines(f)
      if raw is None or raw.strip()
    ]


def rows_digests(workdir: str) -> dict[int, str]:
  """`{round: chain digest of rounds 1..round}` for as long as both
  records files hold rounds 1, 2, ... in order, each once and readable
  ({} where a file is missing or starts late: nothing to check against).
  """
  metrics = _rows(os.path.join(workdir, METRICS_FILE))
  clients = _rows(os.path.join(workdir, CLIENTS_FILE))
  found, digest = {}, NO_ROWS
  for r, (row, clients_row) in enumerate(zip(metrics, clients), 1):
    if row is None or clients_row is None:
      break
    if row['round'] != r or clients_row['round'] != r:
      break
    digest = chain(digest, row, clients_row)
    found[r] = digest
  return found


def _disagree(workdir: str) -> tuple[int, str] | None:
  """The first round whose metrics row names other clients (or another
  number of examples) than its clients row, and why; None if none does.
  Rows without these fields (of earlier versions) are not compared."""
  by_round = {}
  for row in _rows(os.path.join(workdir, CLIENTS_FILE)):
    if row is not None:
      by_round.setdefault(row['round'], row)
  for row in _rows(os.path.join(workdir, METRICS_FILE)):
    other = by_round.get(row['round']) if row is not None else None
    if other is None or 'client_ids' not in row:
      continue
    try:
      ids = [c['id'] for c in other['clients']]
      examples = sum(c['examples'] for c in other['clients'])
    except (TypeError, KeyError):
      ids, examples = None, None
    if ids != row['client_ids'] or examples != row.get('num_examples'):
      return row['round'], (
        f'round {row["round"]} of {METRICS_FILE} and {CLIENTS_FILE} name '
        'other clients'
      )
  return None


def round_rows(
  r: int, metrics: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
  """Round r's metrics row and clients row, from its metrics on the host
  (the engine's, with the per-client ones [K])."""
  row = {
    'round': r,
    'train_loss': float(metrics['train_loss']),
    'num_examples': int(metrics['num_examples']),
    'num_steps': int(metrics['num_steps']),
  }
  row.update(
    {
      k: _to_json(v)
      for k, v in metrics.items()
      if k not in row and k not in engine.PER_CLIENT_METRICS
    }
  )
  # Who trained this round: the energy simulation replays it.
  row['client_ids'] = [int(i) for i in metrics['client_ids']]
  clients_row = {
    'round': r,
    'clients': [
      {'id': int(i), 'examples': int(n), 'steps': int(t), 'loss': _loss(x)}
      for i, n, t, x in zip(
        metrics['client_ids'],
        metrics['client_examples'],
        metrics['client_steps'],
        metrics['client_loss'],
      )
    ],
  }
  # A deployed round names the clients whose reply failed
  # (`fedjax_mr.deploy`); they trained nothing that was aggregated.
  failed = set(row.get('failed_clients', ()))
  for client in clients_row['clients']:
    if client['id'] in failed:
      client['failed'] = True
  return row, clients_row


def write_run_files(
  config: config_lib.ExperimentConfig,
  workdir: str,
  resumed: bool,
  partition: dict[str, Any] | None,
  data: Mapping[str, Any] | None = None,
) -> None:
  """Writes config.json (`write_config`: the config and the fingerprint
  of the `data` loaded) and partition.json."""
  saved = config.to_dict()
  if data is not None:
    saved[DATA_KEY] = dict(data)
  write_config(workdir, saved, resumed)
  if partition is not None:
    partition_lib.save_summary(os.path.join(workdir, PARTITION_FILE), partition)


def write_config(workdir: str, saved: Mapping[str, Any], resumed: bool) -> None:
  """Writes config.json of any kind of run: `saved` (what defines the run)
  and one provenance record per process that ran or, `resumed`, resumed
  the run."""
  config_path = os.path.join(workdir, CONFIG_FILE)
  records = _provenance_records(config_path) if resumed else []
  records.append(provenance.collect())
  metrics_io.write_json(
    config_path, {**saved, PROVENANCE_KEY: records}, indent=2
  )


def _provenance_records(config_path: str) -> list[dict[str, Any]]:
  """The provenance records of an earlier config.json (none if unreadable
  or missing: the checkpoint, not this file, defines the run)."""
  try:
    records = jsonfile.load(config_path, checks.MAX_CONFIG_BYTES)
  except jsonfile.JsonFileError:
    return []
  records = records.get(PROVENANCE_KEY, [])
  if not isinstance(records, list):
    return []
  return [r for r in records if isinstance(r, dict)]


def saved_data(config_path: str) -> dict[str, Any] | None:
  """The data fingerprint of a config.json (None if it has none: a run
  made before fingerprints, or an unreadable file)."""
  try:
    found = jsonfile.load(config_path, checks.MAX_CONFIG_BYTES)
  except jsonfile.JsonFileError:
    return None
  found = found.get(DATA_KEY)
  return found if isinstance(found, dict) else None


def intact_rounds(workdir: str) -> tuple[int | None, str]:
  """The last round up to which the records of `workdir` read, row after
  row (`metrics_io.intact_prefix` of metrics.jsonl and clients.jsonl; a
  missing file does not count), and what stops them: a row that does not
  read, or the end of the file. A round's rows are written before its
  checkpoint, so a checkpoint past that round means that rows were lost
  (a cut at a line's end reads like a whole file).

  Returns:
    `(round, reason)`: `(None, '')` when there is no records file.
  """
  found, why = None, ''
  for name in (METRICS_FILE, CLIENTS_FILE):
    path = os.path.join(workdir, name)
    if not os.path.exists(path):
      continue
    last, stop = metrics_io.intact_prefix(path)
    if found is None or last < found:
      found = last
      why = f'{path}: {stop}' if stop else f'{path} ends at round {last}'
  disagree = _disagree(workdir)
  if disagree is not None and found is not None and disagree[0] - 1 < found:
    found, why = disagree[0] - 1, f'{workdir}: {disagree[1]}'
  return found, why


class Records:
  """A run's rows: metrics.jsonl, clients.jsonl, the TensorBoard events
  (`config.run.tensorboard`) and the history in memory.

  Only the primary process writes files; every process keeps `written`,
  the last round whose rows are written.
  """

  def __init__(
    self,
    workdir: str,
    start: int,
    primary: bool,
    log: Callable[[str], None],
    *,
    tensorboard: bool = False,
    curve: Callable[[list[dict[str, Any]]], None] | None = None,
  ):
    """Opens the records of a run that starts after round `start`; the
    primary process drops the rows past it (a resumed run's). With
    `tensorboard`, each metrics row goes to TensorBoard's events too;
    `curve(rows)` plots the rows of a diverged run."""
    self._workdir, self._tensorboard, self._curve = workdir, tensorboard, curve
    self._start, self._primary = start, primary
    self.metrics_path = os.path.join(workdir, METRICS_FILE)
    self._clients_path = os.path.join(workdir, CLIENTS_FILE)
    self.history: list[dict[str, Any]] = []
    if primary:
      self.history = self._read_back(log)
    # The digest of the rows written (`chain`); None when the records do
    # not hold rounds 1..start (a run resumed without them, or another
    # process than the one that writes them), whose checkpoints then keep
    # none.
    self.chain = NO_ROWS if start == 0 else rows_digests(workdir).get(start)
    self.written = start
    self._clients_written = start
    self._events = None  # the TensorBoard writer, opened with the first row

  def _read_back(self, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The metrics rows up to `start`; later rows (and unreadable ones)
    are dropped from both files."""
    start = self._start
    if start > 0 and not os.path.exists(self.metrics_path):
      log(
        f'{self.metrics_path} is missing: rounds 1-{start} of this run have '
        'no metrics rows (the checkpoint resumes the training itself)'
      )
    history, dropped = metrics_io.truncate(self.metrics_path, start)
    if dropped:
      log(f'{self.metrics_path}: {dropped}')
    _, dropped = metrics_io.truncate(self._clients_path, start)
    if dropped:
      log(f'{self._clients_path}: {dropped}')
    return history

  def binding(self) -> dict[str, str]:
    """What a checkpoint saved now keeps of the rows written up to it:
    `{ROWS_KEY: digest}`, or {} where their digest is unknown."""
    return {} if self.chain is None else {ROWS_KEY: self.chain}

  def write(self, row: dict[str, Any], clients_row: dict[str, Any]) -> None:
    """Writes a finished round's rows and keeps its metrics row."""
    if self._primary:
      self._write_clients_row(clients_row)
      metrics_io.append(self.metrics_path, row)
    if self.chain is not None:
      self.chain = chain(self.chain, row, clients_row)
    self.written = row['round']
    # After `written`: an interrupt here must not write the rows again.
    self._write_events(row)
    self.history.append(row)

  def write_diverged(
    self, row: dict[str, Any], clients_row: dict[str, Any]
  ) -> None:
    """Writes the rows of a round whose loss is not finite, and the
    learning curve up to it (the divergence marked)."""
    if not self._primary:
      return
    self._write_clients_row(clients_row)
    metrics_io.append(self.metrics_path, row)
    self._write_events(row)
    if self._curve is not None:
      self._curve([*self.history, row])

  def _write_clients_row(self, clients_row: dict[str, Any]) -> None:
    # Once per round, also when an interrupt lands between this row and
    # the metrics row and the round's record is finished on the way out.
    if clients_row['round'] > self._clients_written:
      metrics_io.append(self._clients_path, clients_row)
      self._clients_written = clients_row['round']

  def _write_events(self, row: dict[str, Any]) -> None:
    if not (self._primary and self._tensorboard):
      return
    if self._events is None:
      # A resumed run's file makes TensorBoard drop the rounds it redoes.
      self._events = tensorboard.EventWriter(
        os.path.join(self._workdir, tensorboard.FOLDER),
        purge_step=self._start + 1 if self._start else None,
      )
    self._events.scalars(row['round'], row)

  def close(self) -> None:
    """Closes the TensorBoard events file, if one was opened."""
    if self._events is not None:
      self._events.close()


def plot_curve(
  config: config_lib.ExperimentConfig,
  history: Sequence[Mapping[str, Any]],
  workdir: str,
) -> None:
  """Writes a run's learning curves (`plots.curves_figure`) as
  `<workdir>/learning_curve.png`."""
  plots.plot_curves(
    {registry.display_name(config.algorithm.name): {config.run.seed: history}},
    os.path.join(workdir, CURVE_FILE),
    title=setting_title(config),
  )


def _loss(x: Any) -> float | None:
  """A client's loss as JSON: null where it is not a number (a secure
  round's clients keep their losses to the sum; a diverged client)."""
  x = float(x)
  return x if math.isfinite(x) else None


def _to_json(v: Any) -> Any:
  v = np.asarray(v)
  return v.item() if v.ndim == 0 else v.tolist()


# Short texts that name a run's setting: in its log, in figures' titles.


def rounds(n: int) -> str:
  """`1 round`, `20 rounds`."""
  return f'{n} round' + ('' if n == 1 else 's')


# Shown by `setting_title` in its fixed part, or not a setting.
_TITLE_FIELDS = {
  'dataset',
  'model',
  'partition',
  'alpha',
  'shards_per_client',
  'partition_file',
  'partition_sha256',
  'synthetic_alpha',
  'synthetic_beta',
  'num_clients',
  'clients_per_round',
  'local_epochs',
  'batch_size',
  'lr',
  'momentum',
  'rounds',
  'algorithm',
  'seed',
  'data_dir',
  'eval_every',
  'local_eval_every',
  'eval_batch_size',
}


# The names figures and tables give the zoo's models.
MODEL_NAMES = {
  'char_lstm': 'char-LSTM',
  'cnn_cifar': 'CNN (CIFAR)',
  'cnn_fedavg': 'CNN (FedAvg)',
  'cnn_femnist': 'CNN (FEMNIST)',
  'cnn_mnist': 'CNN (MNIST)',
  'logistic': 'logistic regression',
  'resnet18': 'ResNet-18',
  'resnet18_w16': 'ResNet-18 (width 16)',
  'resnet20': 'ResNet-20',
  'vgg16': 'VGG-16',
}


def setting_title(config: config_lib.ExperimentConfig) -> str:
  """The setting a comparison ran, in the figures' names: dataset, model,
  partition (α), clients, E, B, lr, momentum, rounds, and every other
  field that defines the run and differs from its default (an algorithm's
  own fields excepted: they belong to the variants).

  E.g. 'Fashion-MNIST, CNN (MNIST), Dir(α = 0.1), K = 10 of 100, E = 5,
  B = 50, lr = 0.01, momentum = 0.9, 100 rounds'.
  """
  c = config
  part = {
    'dirichlet': f'Dir(α = {c.partition.alpha:g})',
    'dirichlet_equal': f'Dir(α = {c.partition.alpha:g}), equal sizes',
    'shards': f'{c.partition.shards_per_client} shards per client',
    'file': f'partition file {c.partition.sha256[:8]}',
    'iid': 'IID',
    'natural': 'LEAF users as clients',
  }.get(c.partition.kind, c.partition.kind)
  data = datasets.DISPLAY_NAMES.get(c.data.dataset, c.data.dataset)
  if c.data.dataset == datasets.SYNTHETIC:
    data = (
      f'{data}(α = {c.data.synthetic_alpha:g}, β = {c.data.synthetic_beta:g})'
    )
    part = ''
  title = ', '.join(
    x
    for x in (
      data,
      MODEL_NAMES.get(c.model.name, c.model.name),
      part,
      f'K = {c.server.clients_per_round} of {c.partition.num_clients}',
      f'E = {c.local.local_epochs}, B = {c.local.batch_size}, lr = '
      f'{c.local.lr:g}',
      f'momentum = {c.local.momentum:g}, {rounds(c.run.rounds)}',
    )
    if x
  )
  values = c.flat()
  extra = [
    f'{f.name}={values[f.name]}'
    for f in config_lib.base_fields()
    if not f.metadata['run_only']
    and f.name not in _TITLE_FIELDS
    and values[f.name] != f.default
  ]
  return title + ''.join(f', {e}' for e in extra)
