"""Atomic, keep-N checkpoints of the round state (orbax)."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import sys
import time
from typing import Any
from typing import Callable

import jax
import orbax.checkpoint as ocp
from absl import logging as absl_logging

from fedjax_mr.core import errors

# The folder of a workdir that holds the checkpoints.
FOLDER = 'checkpoints'


class _OrbaxErrorsQuiet:
  """Drops orbax's own error log lines while a save runs: a failed write
  is raised (and reported in one line) by `save` itself."""

  def filter(self, record: logging.LogRecord) -> bool:
    in_orbax = f'{os.sep}orbax{os.sep}' in record.pathname
    return not (record.levelno >= logging.ERROR and in_orbax)

  def __enter__(self):
    self._loggers = [absl_logging.get_absl_logger(), logging.getLogger()]
    for logger in self._loggers:
      logger.addFilter(self)
    return self

  def __exit__(self, *exc) -> None:
    for logger in self._loggers:
      logger.removeFilter(self)


def _ignore_closed_loop_callbacks() -> None:
  """Drops the "Event loop is closed" errors that the TensorStore callbacks
  of an aborted orbax save raise (reported through `sys.unraisablehook`,
  one traceback each, after the save has failed); anything else passes
  on. Installed once per process."""
  previous = sys.unraisablehook
  if getattr(previous, 'fedjax_mr_closed_loop', False):
    return

  def hook(unraisable) -> None:
    value = unraisable.exc_value
    if isinstance(value, RuntimeError) and str(value) == (
      'Event loop is closed'
    ):
      return
    previous(unraisable)

  hook.fedjax_mr_closed_loop = True
  sys.unraisablehook = hook


class _AbortedWritesQuiet(logging.Filter):
  """Drops asyncio's "exception was never retrieved" reports of the writes
  of an aborted save under `folder`: orbax gathers a save's writes in
  futures, and when one write fails the others' futures end with their own
  copy of the error, which asyncio logs whenever the futures are collected
  (at exit, after the one-line report). Other asyncio errors pass on."""

  def __init__(self, folder: str):
    super().__init__()
    self.folder = folder

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (
      'exception was never retrieved' in message and self.folder in message
    )


def _quiet_aborted_writes(folder: str) -> None:
  """Installs `_AbortedWritesQuiet(folder)` on the asyncio logger, once."""
  logger = logging.getLogger('asyncio')
  if not any(
    isinstance(f, _AbortedWritesQuiet) and f.folder == folder
    for f in logger.filters
  ):
    logger.addFilter(_AbortedWritesQuiet(folder))


class CheckpointError(errors.UserError):
  """No checkpoint of a workdir restores."""


class Checkpointer:
  """Saves and restores round states under `<workdir>/checkpoints/<round>`.

  Orbax writes each checkpoint to a temporary folder and renames it when
  complete, so a run killed while saving leaves the previous one intact.
  """

  def __init__(self, workdir: str, keep: int = 2):
    self._folder = os.path.abspath(os.path.join(workdir, FOLDER))
    self._keep = keep
    self._manager = self._new_manager()

  def _new_manager(self) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
      self._folder,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=self._keep, create=True, enable_async_checkpointing=False
      ),
    )

  def latest_round(self) -> int | None:
    """Rounds completed at the newest checkpoint, or None."""
    return self._manager.latest_step()

  def all_rounds(self) -> list[int]:
    """The rounds of every checkpoint kept, oldest first."""
    return sorted(self._manager.all_steps())

  def restore_newest(
    self,
    like: Any,
    log: Callable[[str], None],
    move_aside: bool = True,
  ) -> tuple[int | None, Any]:
    """The newest checkpoint that restores, falling back over damaged ones.

    A checkpoint whose files are damaged (garbled or truncated data, a
    missing item folder, an empty round folder) does not restore; the next
    older one is tried. Each one skipped is reported in one line and, with
    `move_aside` (the primary process), moved to
    `<workdir>/checkpoints_damaged/<round>.<time>` (kept, not deleted) so
    that the run can save that round again.

    Returns:
      `(round, state)`, or `(None, like)` when there is no checkpoint.

    Raises:
      CheckpointError: checkpoints exist but none restores (nothing is
        moved then: a workdir of another run's layout is not touched).
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    failed = []
    for step in steps:
      try:
        state = self.restore(step, like)
      except Exception as e:  # noqa: BLE001 (orbax/TensorStore raise many)
        reason = ' '.join(str(e).split())[:200] or type(e).__name__
        failed.append((step, reason))
        # A failed restore can leave the manager with a wrong idea of the
        # checkpoints' items: the next one is read by a fresh manager.
        self._manager.close()
        self._manager = self._new_manager()
        continue
      for bad, reason in failed:
        where = self._damaged_path(bad)
        if move_aside:
          os.makedirs(os.path.dirname(where), exist_ok=True)
          shutil.move(self._step_path(bad), where)
        log(
          f'checkpoint after round {bad} does not restore ({reason}); '
          f'resuming from round {step}'
          + (f', the damaged one moved to {where}' if move_aside else '')
        )
      if failed:
        self._manager.close()
        self._manager = self._new_manager()
      return step, state
    if failed:
      step, reason = failed[0]
      raise CheckpointError(
        f'no checkpoint in {self._folder} restores (the newest, '
        f'after round {step}: {reason}); if the workdir holds a run of '
        'another setting, pass another `workdir`'
      )
    return None, like

  def _step_path(self, step: int) -> str:
    return os.path.join(self._folder, str(step))

  def _damaged_path(self, step: int) -> str:
    root = os.path.dirname(self._folder)
    stamp = time.strftime('%Y%m%d-%H%M%S')
    return os.path.join(root, 'checkpoints_damaged', f'{step}.{stamp}')

  def save(
    self, round_index: int, state: Any, metadata: dict[str, Any] | None = None
  ) -> None:
    """Saves `state` as the checkpoint after `round_index` rounds, with a
    JSON-able `metadata` dict inside it (the run's config).

    Raises:
      StorageError: the checkpoint cannot be written (a full disk, a
        read-only folder); its partial files are removed, the previous
        checkpoints are untouched.
    """
    # When one write of a save fails, the save's other writes still end,
    # one by one, and each reports to an event loop that orbax has closed.
    _ignore_closed_loop_callbacks()
    _quiet_aborted_writes(self._folder)
    try:
      with _OrbaxErrorsQuiet():
        self._manager.save(
          int(round_index),
          args=ocp.args.StandardSave(state),
          force=True,
          custom_metadata=metadata,
        )
        self._manager.wait_until_finished()
      return
    except Exception as e:
      reason = errors.os_reason(e)
      if reason is None:
        raise
    # Out of the except block, so the raised error does not hold orbax's
    # exception (its context) and with it the failed writes' futures.
    with contextlib.suppress(Exception), _OrbaxErrorsQuiet():
      self._manager.close()
    for partial in glob.glob(f'{self._step_path(round_index)}.orbax-*'):
      shutil.rmtree(partial, ignore_errors=True)
    raise errors.StorageError(
      f'cannot write the checkpoint after round {round_index} in '
      f'{self._folder}: {reason}'
    )

  def metadata(self, round_index: int) -> dict[str, Any]:
    """The metadata saved with checkpoint `round_index` ({} for a
    checkpoint saved without metadata, as older versions saved them)."""
    try:
      found = self._manager.metadata(int(round_index)).custom_metadata
    except Exception:  # noqa: BLE001 (no step metadata file)
      return {}
    return dict(found or {})

  def restore(self, round_index: int, like: Any) -> Any:
    """Restores the checkpoint `round_index` into the structure of `like`."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    return self._manager.restore(
      int(round_index), args=ocp.args.StandardRestore(abstract)
    )

  def close(self) -> None:
    self._manager.close()
