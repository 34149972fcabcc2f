"""Resuming a run, and stopping one so that it can resume.

A workdir that holds a checkpoint resumes from its newest intact one (a
damaged one is skipped: `checkpoint.Checkpointer.find`), at or before the
last intact record row (a cut or garbled row rolls the run back, so that
the row is recomputed), if it was made with the same config and data
(config.json and the copies kept inside the checkpoint must agree) and
the run is not already past `rounds`; the rounds after it are recomputed
identically. A checkpoint is bound to its place: one whose state or
metadata is of another round than its folder's (a copy, a roll back), or
that was saved after other rows than the records hold, is skipped like a
damaged one. Ctrl-C or SIGTERM writes the current round's
rows and checkpoints that round on the way out (`TerminationAsInterrupt`,
`finish_interrupted`), saying so at once (`InterruptAnnounced`), and no
signal lands inside a checkpoint's write (`SignalsDeferred`); a full disk
stops the run with what to do (`storage_error`).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from typing import Any
from typing import Callable
from typing import Mapping

import jax

from fedjax_mr.core import errors
from fedjax_mr.core import workdir as workdir_lib
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import records
from fedjax_mr.runtime import checkpoint
from fedjax_mr.runtime import distributed
from fedjax_mr.training import engine

Log = Callable[[str], None]


# The folders a run writes in its workdir (besides checkpoint.FOLDER).
OWN_FOLDERS = (checkpoint.DAMAGED_FOLDER, 'tensorboard')


def check_workdir(config: config_lib.ExperimentConfig, workdir: str) -> None:
  """Refuses another run's workdir (a live run's, or one of another
  config) and one whose files are not its own (a symbolic link among
  them, a file where its checkpoints folder belongs) before anything is
  loaded; the primary process only, which is the one that holds the
  workdir (see `experiment.run`)."""
  if distributed.is_primary():
    workdir_lib.check_free(workdir)
    check_entries(workdir)
    config_path = os.path.join(workdir, records.CONFIG_FILE)
    if os.path.exists(config_path):
      checks.check_resumable(config, config_path)


def check_entries(workdir: str) -> None:
  """Raises `ConfigError` if a file or folder that a run writes in
  `workdir` (its records, its checkpoints folder and each checkpoint in
  it) is a symbolic link, or not a file (a folder) where it should be:
  nothing is written through a link, and a checkpoints folder that is a
  file is found before a round is trained, not when it is saved."""
  workdir_lib.check_entries(
    workdir,
    files=records.OWN_FILES,
    folders=(checkpoint.FOLDER, *OWN_FOLDERS),
  )
  folder = os.path.join(workdir, checkpoint.FOLDER)
  if os.path.isdir(folder):
    links = sorted(e.name for e in os.scandir(folder) if e.is_symlink())
    workdir_lib.check_entries(
      workdir,
      folders=[os.path.join(checkpoint.FOLDER, e) for e in links],
    )


def restore(
  config: config_lib.ExperimentConfig,
  workdir: str,
  state: engine.RoundState,
  log: Callable[[str], None],
  primary: bool,
  data: Mapping[str, Any] | None = None,
) -> tuple[checkpoint.Checkpointer | None, int | None, engine.RoundState]:
  """The newest intact checkpoint of `workdir` at or before its last
  intact record row, if the run may resume from it.

  A checkpoint that does not restore or does not match its digest is
  skipped for the next older one (`Checkpointer.find`). A record row that
  does not read, or a records file that ends before a checkpoint's round
  (metrics.jsonl or clients.jsonl, `records.intact_rounds`), rolls the run
  back to a checkpoint at or before the last intact row, so that the rows
  from there on are recomputed; the checkpoints past it are deleted (the
  primary process), none left: the run starts over.
  Nothing is written or moved before the checks (config, data) pass.

  Args:
    config: the run.
    workdir: its folder.
    state: the initial state (its layout is the checkpoint's).
    log: where notes go (a damaged checkpoint, a roll back).
    primary: whether this process writes the workdir.
    data: the fingerprint of the data loaded (`build.data_fingerprint`),
      checked against config.json's and the checkpoint's; None: not
      checked.

  Returns:
    (checkpointer or None, rounds done or None, state): None and the
    initial state where there is no checkpoint to resume from.

  Raises:
    ConfigError: config.json or the checkpoint was made with another
      config or other data, or the run is already past `config.run.rounds`.
    CheckpointError: checkpoints exist but none is intact.
  """
  config_path = os.path.join(workdir, records.CONFIG_FILE)
  # Only the primary process reads and writes config.json: the others
  # could find the file the primary has just written for this very run.
  if primary and os.path.exists(config_path):
    checks.check_resumable(config, config_path)
    _check_data(config, workdir, records.saved_data(config_path), data)

  def accept(step: int, metadata: Mapping[str, Any], resumed: bool) -> None:
    _check_checkpoint(config, workdir, step, metadata, data)
    if resumed:
      _check_rounds(config, workdir, step)

  return restore_checkpoint(
    workdir, state, config.run.keep_checkpoints, log, primary, accept
  )


def restore_checkpoint(
  workdir: str,
  like: Any,
  keep: int,
  log: Log,
  primary: bool,
  accept: Callable[[int, Mapping[str, Any], bool], None],
) -> tuple[checkpoint.Checkpointer | None, int | None, Any]:
  """`restore` of any kind of run (training or FedStitch): the newest
  intact checkpoint of `workdir` at or before its last intact record row,
  bound to the rows the records hold (`bound_to`); the damaged ones moved
  aside and those past the intact rows deleted, after the checks.

  Args:
    workdir: the run's folder.
    like: the state's layout (None: each checkpoint's own, as saved).
    keep: how many checkpoints the run keeps.
    log: where notes go.
    primary: whether this process writes the workdir (moves, deletes).
    accept: `accept(round, metadata, resumed)` raises `ConfigError` for
      a checkpoint of another run: the one resumed from (`resumed`) and
      each one past the intact rows (deleted when this run's).

  Returns:
    (checkpointer or None, rounds done or None, state): see `restore`.
  """
  intact, why = records.intact_rounds(workdir)
  folder = os.path.join(workdir, checkpoint.FOLDER)
  if not os.path.isdir(folder) or not _steps(folder):
    _starts_over(folder, intact, log)
    return None, None, like
  ckpt = checkpoint.Checkpointer(workdir, keep=keep)
  check = bound_to(records.rows_digests(workdir))
  found = ckpt.find(like, at_most=intact, check=check)
  ckpt.check_found(found)
  start = found.round
  if start is not None:
    accept(start, found.metadata, True)
  found = _strays_aside(ckpt, found, accept)
  ckpt.settle(found, log, move_aside=primary)
  if found.later:
    log(
      f'{why}; the rounds from {(start or 0) + 1} on are recomputed, from '
      + (f'the checkpoint after round {start}' if start else 'the start')
    )
  elif start is None:
    _starts_over(folder, intact, log)
  if start is not None and not found.verified:
    log(
      f'note: the checkpoint after round {start} has no digest (made by an '
      'earlier version): it is resumed as it reads, unverified'
    )
  return ckpt, start, found.state


def _starts_over(folder: str, intact: int | None, log: Log) -> None:
  """Says that a run whose records hold rows (up to round `intact`) but
  whose checkpoints `folder` holds none to resume from starts over, and
  that its rows are recomputed."""
  if intact:
    log(
      f'{folder} holds no checkpoint to resume from, but the records hold '
      f'rows up to round {intact}: the run starts over from round 1, and '
      'those rows are recomputed'
    )


def _steps(folder: str) -> list[str]:
  """The names in a checkpoints folder that orbax reads as checkpoints
  (a round number)."""
  return [name for name in os.listdir(folder) if name.isdigit()]


def bound_to(
  digests: Mapping[int, str],
) -> Callable[[int, Any, Mapping[str, Any]], str]:
  """The check (`Checkpointer.find`'s `check`) that a checkpoint holds the
  state of its own round and was saved after the rows that a workdir's
  records hold up to it (`digests`: `records.rows_digests`; a round that
  they do not hold whole, or a checkpoint of an earlier version without
  the rows' digest, is not checked)."""

  def check(step: int, state: Any, metadata: Mapping[str, Any]) -> str:
    held = getattr(state, 'round', None)
    if held is not None and int(held) != step:
      return (
        f'it holds the state after round {int(held)}, not {step}: a copy '
        'or a roll back in the wrong folder'
      )
    saved = metadata.get(records.ROWS_KEY)
    if saved is None or step not in digests or digests[step] == saved:
      return ''
    return (
      f'it was saved after other rows than {records.METRICS_FILE} and '
      f'{records.CLIENTS_FILE} hold up to round {step} (a row changed, or '
      'the checkpoint is of another attempt)'
    )

  return check


def _strays_aside(
  ckpt: checkpoint.Checkpointer,
  found: checkpoint.Found,
  accept: Callable[[int, Mapping[str, Any], bool], None],
) -> checkpoint.Found:
  """`found` with the checkpoints past the intact rows sorted: this run's
  (`accept`ed: its config, its round) are deleted as before (their rounds
  are recomputed); a folder that holds no checkpoint of its round (empty,
  or a copy of another round's) is moved aside as damaged, not deleted,
  and one of another config is refused (not touched)."""
  later, strays = [], []
  for step in found.later:
    saved = ckpt.round_of(step)
    metadata = ckpt.metadata(step)
    if not metadata or saved not in (None, step):
      held = 'no checkpoint' if not metadata else f"round {saved}'s"
      strays.append((step, f"the folder holds {held}, not round {step}'s"))
      continue
    # Deleted below: it must be this run's.
    accept(step, metadata, False)
    later.append(step)
  return found._replace(later=later, damaged=found.damaged + strays)


def _check_rounds(
  config: config_lib.ExperimentConfig, workdir: str, start: int
) -> None:
  """Refuses to resume the run after round `start` if it is already past
  `config.run.rounds`."""
  if start > config.run.rounds:
    raise errors.ConfigError(
      f'`rounds={config.run.rounds}`: the run in {workdir} is already past it '
      f'({start} rounds done); pass `rounds={start}` or more to resume it'
    )


def _check_checkpoint(
  config: config_lib.ExperimentConfig,
  workdir: str,
  start: int,
  metadata: Mapping[str, Any],
  data: Mapping[str, Any] | None,
) -> None:
  """Refuses the checkpoint after round `start` (its `metadata`) if it was
  made with another config or other data."""
  # The config a checkpoint was made with is kept inside it: config.json
  # alone could be deleted or replaced.
  saved = metadata.get('config')
  diffs = checks.config_diffs(config, saved) if saved else []
  if diffs:
    raise errors.ConfigError(
      f'the checkpoint after round {start} in {workdir} was made with '
      f'another config ({"; ".join(diffs)}); pass another `workdir` or '
      'the same flags'
    )
  _check_data(config, workdir, metadata.get('data'), data)


def _check_data(
  config: config_lib.ExperimentConfig,
  workdir: str,
  saved: Mapping[str, Any] | None,
  data: Mapping[str, Any] | None,
) -> None:
  """Refuses to resume the run in `workdir` on data (`data`, a
  fingerprint) other than those it was made with (`saved`; a run made
  before fingerprints has none, and is not checked)."""
  if not saved or data is None or dict(saved) == dict(data):
    return
  keys = sorted(set(saved) | set(data))
  what = [k for k in keys if saved.get(k) != data.get(k)]
  raise errors.ConfigError(
    f'`data_dir={config.data.data_dir}`: the {config.data.dataset} data loaded '
    'from '
    f'it differ from those the run in {workdir} was made with '
    f'({", ".join(what)} differ); pass the folder of the same data, or '
    'another `workdir`'
  )


def announce(
  workdir: str,
  start: int,
  before: Mapping[str, Any] | None,
  mapping: Mapping[str, Any],
  log: Callable[[str], None],
) -> None:
  """Logs that the run resumes after round `start`, and whether its
  client mapping (`before`: the checkpoint's) changed to `mapping`."""
  log(f'resuming {workdir} after round {start}')
  if before and before != mapping:
    log(
      f'note: round {start} was run with '
      f'{distributed.describe_mapping(before)}, this process runs '
      f'{distributed.describe_mapping(mapping)}: the sums over clients are '
      'grouped differently, so the results are not bit-identical to an '
      'uninterrupted run (differences start in the last digits)'
    )


def storage_error(
  e: OSError | errors.StorageError, saved_round: int
) -> errors.StorageError:
  """The error that stops a run on a full disk or a folder that became
  read-only (`e`), after round `saved_round`'s checkpoint: what is
  written stays (a partial metrics row is dropped on resume)."""
  what = (
    str(e)
    if isinstance(e, errors.StorageError)
    else f'cannot write {e.filename or "a file"}: {e.strerror or e}'
  )
  return errors.StorageError(
    f'{what}; stopped. Nothing written before is lost: free space (or '
    f'make the folder writable) and re-run the same command, it resumes '
    f'after round {saved_round}'
  )


def finish_interrupted(
  *,
  pending: int | None,
  finish: Callable[[], Any],
  rows: records.Records,
  state: Any,
  saved_round: int,
  save: Callable[[int, Any], None],
  log: Callable[[str], None],
) -> None:
  """What an interrupted run does on its way out: finish the rows of round
  `pending` (whose state is computed), then checkpoint the last round
  whose rows are written, unless it is saved already.

  Most of a round is spent waiting for its results, so that is where a
  signal usually lands: the state has advanced but the row is missing.
  The row comes first; a checkpoint without it would make the resumed
  run skip that round's metrics.

  Args:
    pending: the round whose rows are not written, or None.
    finish: writes them.
    rows: the run's records (`rows.written`: the last round written).
    state: the current state (deleted if the interrupt landed while a
      round consumed it).
    saved_round: the round of the last checkpoint.
    save: `save(round, state)` checkpoints `state`, the state after
      `round` rounds, with what the records hold up to it.
    log: where notes go.
  """
  if pending is not None and rows.written < pending and alive(state):
    try:
      finish()
    except (KeyboardInterrupt, errors.NonFiniteError):
      log(
        f'round {pending} could not be finished; the run resumes '
        f'after round {saved_round}'
      )
  written = rows.written
  if alive(state) and written > saved_round and int(state.round) == written:
    # A second interrupt waits for this save (and then ends the run).
    with SignalsDeferred():
      save(written, state)
      log(f'interrupted: saved a checkpoint after round {written}')


def alive(tree: Any) -> bool:
  """Whether no array of `tree` was deleted (donated to a round)."""
  return not any(
    getattr(x, 'is_deleted', lambda: False)() for x in jax.tree.leaves(tree)
  )


class TerminationAsInterrupt:
  """Turns SIGTERM into KeyboardInterrupt so a killed run checkpoints."""

  def __enter__(self):
    self._previous = None
    try:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not in the main thread
      pass
    return self

  def _handle(self, signum, frame):
    raise KeyboardInterrupt

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
    return False


# What `finish_interrupted` will do, said at once (`InterruptAnnounced`).
INTERRUPTED = (
  'interrupted: the round in flight finishes first, then the run saves a '
  'checkpoint and stops'
)


class InterruptAnnounced:
  """Says at once that Ctrl-C (or SIGTERM) was heard, with `log(line)`.

  Python runs a signal's handler when the main thread runs Python again:
  while a round computes (the main thread waits for its results in XLA)
  that is when the round is done, seconds to minutes later, and nothing
  is said meanwhile. Here the signal's C handler also writes a byte to a
  socket (`signal.set_wakeup_fd`), and a thread waiting on it logs `line`
  at the first SIGINT or SIGTERM. Where the process has a wakeup fd
  already, or outside the main thread, it does nothing.
  """

  _SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self, log: Log, line: str = INTERRUPTED):
    self._log = log
    self._line = line

  def __enter__(self):
    self._thread = None
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
      previous = signal.set_wakeup_fd(
        writer.fileno(), warn_on_full_buffer=False
      )
    except ValueError:  # not in the main thread
      previous = None
    if previous != -1:  # another wakeup fd, or none could be set
      if previous is not None:
        signal.set_wakeup_fd(previous)
      reader.close()
      writer.close()
      return self
    self._writer = writer
    self._thread = threading.Thread(
      target=self._announce, args=(reader,), daemon=True
    )
    self._thread.start()
    return self

  def _announce(self, reader: socket.socket) -> None:
    # Reads until the writer closes: a write to a closed reader would be
    # an error the signal's handler reports.
    said = False
    with reader:
      while data := reader.recv(64):  # b'': the writer closed
        if not said and any(signum in self._SIGNALS for signum in data):
          self._log(self._line)
          said = True

  def __exit__(self, *exc):
    if self._thread is not None:
      signal.set_wakeup_fd(-1)
      self._writer.close()
      self._thread.join()
    return False


class SignalsDeferred:
  """Holds SIGINT and SIGTERM back while a checkpoint is written.

  An interrupt inside orbax's save abandons a half-written temporary
  folder, and the interrupt handler then saves the same round again (with
  an older orbax that second save failed, `OSError: Directory not empty`,
  2 runs in 11; orbax 0.12.8 removes the folder first). Inside this block
  the two signals are only recorded (Python runs signal handlers in the
  main thread between bytecodes, so a recording handler never interrupts
  the save); on leaving it, a recorded signal becomes the
  KeyboardInterrupt it would have been, after the checkpoint is complete.
  """

  _SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __enter__(self):
    self._got = None
    self._previous = {}
    try:
      for s in self._SIGNALS:
        self._previous[s] = signal.signal(s, self._record)
    except ValueError:  # not in the main thread: nothing to defer
      self._previous = {}
    return self

  def _record(self, signum, frame):
    del frame
    self._got = signum

  def __exit__(self, exc_type, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    if self._got is not None and exc_type is None:
      raise KeyboardInterrupt
    return False
