"""Atomic, keep-N checkpoints of the round state (orbax), each proving its
content and its place: a sha256 of its arrays and metadata, computed from
the values before the write and saved in the same atomic save (`digest`),
is checked on restore, and the metadata names the round it was saved
after (`ROUND_KEY`), which must be its folder's; a checkpoint that does not
match, does not read or sits in another round's folder (a copy, a roll
back) is skipped for the newest intact one (`Checkpointer.find`), which
may also be refused by the caller's own check (the records it was saved
after)."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
from typing import Any
from typing import Callable
from typing import NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging

from fedjax_mr.core import errors
from fedjax_mr.core import jsonfile

# The folder of a workdir that holds the checkpoints.
FOLDER = 'checkpoints'
# Where `Checkpointer.settle` moves the damaged ones.
DAMAGED_FOLDER = 'checkpoints_damaged'
# The largest metadata file read (a run's config, mapping and digests are
# a few KB).
MAX_METADATA_BYTES = 16 * 2**20
# The key of a checkpoint's metadata that holds its `digest`.
DIGEST_KEY = 'sha256'
# The key of a checkpoint's metadata that holds the round it was saved
# after (covered by the digest): a copy in another round's folder shows.
ROUND_KEY = 'round'
# orbax's file of a checkpoint's metadata, in the checkpoint's folder
# (written into the temporary folder before the rename that completes a
# save: it is part of the atomic save).
_STEP_METADATA = '_CHECKPOINT_METADATA'
# The keys of the metadata this project saved before digests. A checkpoint
# without a digest whose metadata holds another key is damaged (a byte of
# a key's name changed: the file still reads), not one of an earlier
# version, and is not taken unverified.
_BEFORE_DIGESTS = frozenset({'config', 'mapping'})
# The largest chunk an array is written in: restoring a chunk decodes it
# into a buffer of its size beside the restored array, so an array written
# in one piece (orbax's default up to 2 GiB) needs twice its memory to
# restore (10^6 SCAFFOLD controls: +2.3 GB). Any chunking reads back.
CHUNK_BYTES = 64 << 20


def digest(state: Any, metadata: dict[str, Any]) -> str:
  """The sha256 (hex) of `state`'s arrays and of `metadata` (JSON-able).

  Each leaf, in tree order, adds its path, dtype, shape and bytes (random
  keys their key data); `metadata` adds its sorted JSON. Restored arrays
  have the bytes that were saved, so a restore recomputes the same digest.
  """
  h = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode())
  leaves, _ = jax.tree_util.tree_flatten_with_path(state)
  for path, leaf in leaves:
    a = _host_array(leaf)
    h.update(f'{jax.tree_util.keystr(path)}|{a.dtype.str}|{a.shape}'.encode())
    h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
  return h.hexdigest()


def _host_array(leaf: Any) -> np.ndarray:
  """A leaf's value on the host (a replicated array: one copy of it)."""
  if isinstance(leaf, jax.Array):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    if not leaf.is_fully_addressable and leaf.is_fully_replicated:
      leaf = leaf.addressable_data(0)
  return np.asarray(jax.device_get(leaf))


class _OrbaxErrorsQuiet:
  """Drops orbax's own log lines of `level` and above while a save or a
  restore runs: a failed write is raised (and reported in one line) by
  `save` itself, a checkpoint that does not restore is reported in one
  line by `find`'s caller."""

  def __init__(self, level: int = logging.ERROR):
    self._level = level

  def filter(self, record: logging.LogRecord) -> bool:
    in_orbax = f'{os.sep}orbax{os.sep}' in record.pathname
    return not (record.levelno >= self._level and in_orbax)

  def __enter__(self):
    self._loggers = [absl_logging.get_absl_logger(), logging.getLogger()]
    for logger in self._loggers:
      logger.addFilter(self)
    return self

  def __exit__(self, *exc) -> None:
    for logger in self._loggers:
      logger.removeFilter(self)


class _StepMetadataQuiet(logging.Filter):
  """Drops orbax's log lines about a checkpoint's metadata file that does
  not read or holds a key orbax does not write: orbax reads it as empty or
  moves the key into the custom metadata (in its own threads, whenever a
  manager lists the checkpoints), and `Checkpointer.find` reads it itself
  and reports such a checkpoint as damaged, in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    in_orbax = f'{os.sep}orbax{os.sep}' in record.pathname
    message = record.getMessage()
    return not (
      in_orbax
      and (
        _STEP_METADATA in message
        or message.startswith('Provided metadata contains unknown key')
      )
    )


def _quiet_step_metadata() -> None:
  """Installs `_StepMetadataQuiet` on absl's and the root logger, once."""
  for logger in (absl_logging.get_absl_logger(), logging.getLogger()):
    if not any(isinstance(f, _StepMetadataQuiet) for f in logger.filters):
      logger.addFilter(_StepMetadataQuiet())


def _ignore_closed_loop_callbacks() -> None:
  """Drops the "Event loop is closed" errors that the TensorStore callbacks
  of an aborted orbax save raise, and the errors of the read coroutines
  that a failed restore of damaged files leaves behind (both reported
  through `sys.unraisablehook`, one traceback each, whenever Python
  collects them, after the save or restore has failed and been reported
  in one line); anything else passes on. Installed once per process."""
  previous = sys.unraisablehook
  if getattr(previous, 'fedjax_mr_closed_loop', False):
    return

  def hook(unraisable) -> None:
    value = unraisable.exc_value
    if isinstance(value, RuntimeError) and str(value) == (
      'Event loop is closed'
    ):
      return
    code = getattr(unraisable.object, 'cr_code', None)
    if code is not None and f'{os.sep}orbax{os.sep}' in code.co_filename:
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


def _handlers() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  """orbax's standard handler, writing numpy arrays without a copy.

  orbax copies each numpy array before writing it (`NumpyHandler`'s
  `deepcopy_host_arrays`, a guard for asynchronous saves, which could see
  the array change); `Checkpointer.save` returns only once the write is
  done, so the copy would only double the memory of the host-resident
  per-client state (10^6 SCAFFOLD controls: +2.4 GB). The handler is
  orbax's own class, so the checkpoints name the same handler as before.
  """
  types = ocp.type_handlers
  registry = types.create_type_handler_registry(
    *[
      (
        t,
        types.NumpyHandler(deepcopy_host_arrays=False)
        if t is np.ndarray
        else types.get_type_handler(t),
      )
      for t in types.supported_types()
    ]
  )
  handler = ocp.StandardCheckpointHandler()
  # orbax 0.12 takes no registry for its standard handler: its
  # implementation, built with the default one, is replaced by one built
  # with this registry (the same class and defaults otherwise).
  handler._impl = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
  handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
  handlers.add(None, ocp.args.StandardSave, handler)
  handlers.add(None, ocp.args.StandardRestore, handler)
  return handlers


class CheckpointError(errors.UserError):
  """No checkpoint of a workdir restores."""


class _Damaged(Exception):
  """A checkpoint's metadata does not read, or its arrays do not match
  their digest."""


class Found(NamedTuple):
  """What `Checkpointer.find` found.

  Attributes:
    round: the newest intact checkpoint's round (at most `at_most`), or
      None.
    state: its state (the `like` given to `find` where there is none).
    metadata: its metadata (`Checkpointer.metadata`).
    verified: whether it had a digest (checkpoints made before digests
      have none and are taken as they read).
    damaged: `(round, reason)` of each newer one that does not restore.
    later: the rounds of the checkpoints past `at_most` (not read).
  """

  round: int | None
  state: Any
  metadata: dict[str, Any]
  verified: bool
  damaged: list[tuple[int, str]]
  later: list[int]


def _reason(e: Exception) -> str:
  """Why a checkpoint does not restore, in at most 200 characters: the
  error's first part and, for TensorStore's, the array it read (its
  message goes on with the array's whole spec, cut mid-way)."""
  text = ' '.join(str(e).split())
  head, _, details = text.partition(' See full TensorStore details')
  array = re.search(r"'path': '([^'/]+)/'", details)
  if array:
    head += f' (array {array.group(1)})'
  return head[:200] or type(e).__name__


class Checkpointer:
  """Saves and restores round states under `<workdir>/checkpoints/<round>`.

  Orbax writes each checkpoint to a temporary folder and renames it when
  complete, so a run killed while saving leaves the previous one intact.
  Each checkpoint's metadata holds the `digest` of its arrays and metadata,
  checked when it is restored.
  """

  def __init__(self, workdir: str, keep: int = 2):
    self._folder = os.path.abspath(os.path.join(workdir, FOLDER))
    self._keep = keep
    _quiet_step_metadata()
    self._manager = self._new_manager()

  def _new_manager(self) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
      self._folder,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=self._keep, create=True, enable_async_checkpointing=False
      ),
      handler_registry=_handlers(),
    )

  def _reopen(self) -> None:
    # After a failed restore or a folder moved, the manager can have a
    # wrong idea of the checkpoints: the next one is read by a fresh one.
    with contextlib.suppress(Exception), _OrbaxErrorsQuiet(logging.WARNING):
      self._manager.close()
    self._manager = self._new_manager()

  def latest_round(self) -> int | None:
    """Rounds completed at the newest checkpoint, or None."""
    return self._manager.latest_step()

  def all_rounds(self) -> list[int]:
    """The rounds of every checkpoint kept, oldest first."""
    return sorted(self._manager.all_steps())

  def find(
    self,
    like: Any,
    at_most: int | None = None,
    check: Callable[[int, Any, dict[str, Any]], str] | None = None,
  ) -> Found:
    """The newest intact checkpoint of a round up to `at_most` (any round:
    None), read into the structure of `like`; nothing is written or moved.

    A checkpoint is damaged when its metadata or arrays do not read
    (garbled or truncated files, a missing item folder, an empty round
    folder), do not match its digest, or name another round than its
    folder's; so is one for which `check(round, state, metadata)` returns
    a reason (not ''). The next older one is tried.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    later = [s for s in steps if at_most is not None and s > at_most]
    damaged = []
    for step in steps[len(later) :]:
      try:
        state, meta, verified = self.restore_verified(step, like)
      except Exception as e:  # noqa: BLE001 (orbax/TensorStore raise many)
        damaged.append((step, _reason(e)))
        self._reopen()
        continue
      reason = check(step, state, meta) if check else ''
      if reason:
        damaged.append((step, reason))
        continue
      return Found(step, state, meta, verified, damaged, later)
    return Found(None, like, {}, False, damaged, later)

  def round_of(self, round_index: int) -> int | None:
    """The round that checkpoint `round_index`'s metadata says it was saved
    after (`ROUND_KEY`), or None: no such key (a checkpoint of an earlier
    version) or metadata that does not read."""
    try:
      saved = self._read_metadata(round_index).get(ROUND_KEY)
    except _Damaged:
      return None
    return saved if type(saved) is int else None

  def settle(
    self, found: Found, log: Callable[[str], None], move_aside: bool = True
  ) -> None:
    """Reports each damaged checkpoint of `found` in one line and, with
    `move_aside` (the primary process), moves it to
    `<workdir>/checkpoints_damaged/<round>.<time>` (kept, not deleted) and
    deletes those past its `at_most` (their rounds are recomputed), so
    that the run can save those rounds again."""
    resumed = (
      f'resuming from round {found.round}'
      if found.round is not None
      else 'starting from round 0'
    )
    for bad, reason in found.damaged:
      where = self._damaged_path(bad)
      if move_aside:
        os.makedirs(os.path.dirname(where), exist_ok=True)
        shutil.move(self._step_path(bad), where)
      log(
        f'checkpoint after round {bad} does not restore ({reason}); '
        + resumed
        + (f', the damaged one moved to {where}' if move_aside else '')
      )
    if move_aside:
      for step in found.later:
        shutil.rmtree(self._step_path(step))
    if found.damaged or (move_aside and found.later):
      self._reopen()

  def restore_newest(
    self,
    like: Any,
    log: Callable[[str], None],
    move_aside: bool = True,
  ) -> tuple[int | None, Any]:
    """The newest intact checkpoint (`find`), the damaged ones reported
    and moved aside (`settle`).

    Returns:
      `(round, state)`, or `(None, like)` when there is no checkpoint.

    Raises:
      CheckpointError: checkpoints exist but none restores (nothing is
        moved then: a workdir of another run's layout is not touched).
    """
    found = self.find(like)
    self.check_found(found)
    self.settle(found, log, move_aside)
    return found.round, found.state

  def check_found(self, found: Found) -> None:
    """Raises `CheckpointError` if checkpoints were tried and none is
    intact."""
    if found.round is None and found.damaged:
      step, reason = found.damaged[0]
      raise CheckpointError(
        f'no checkpoint in {self._folder} restores (the newest, '
        f'after round {step}: {reason}); if the workdir holds a run of '
        'another setting, pass another `workdir`'
      )

  def _step_path(self, step: int) -> str:
    return os.path.join(self._folder, str(step))

  def _damaged_path(self, step: int) -> str:
    root = os.path.dirname(self._folder)
    stamp = time.strftime('%Y%m%d-%H%M%S')
    return os.path.join(root, DAMAGED_FOLDER, f'{step}.{stamp}')

  def save(
    self, round_index: int, state: Any, metadata: dict[str, Any] | None = None
  ) -> None:
    """Saves `state` as the checkpoint after `round_index` rounds, with a
    JSON-able `metadata` dict inside it (the run's config) and their
    `digest` (under `DIGEST_KEY`).

    Raises:
      StorageError: the checkpoint cannot be written (a full disk, a
        read-only folder); its partial files are removed, the previous
        checkpoints are untouched.
    """
    # When one write of a save fails, the save's other writes still end,
    # one by one, and each reports to an event loop that orbax has closed.
    _ignore_closed_loop_callbacks()
    _quiet_aborted_writes(self._folder)
    # The temporary folder of a save that a kill cut short: orbax would
    # remove it itself, with a warning to the user.
    for partial in glob.glob(f'{self._step_path(round_index)}.orbax-*'):
      shutil.rmtree(partial, ignore_errors=True)
    metadata = {**(metadata or {}), ROUND_KEY: int(round_index)}
    # From the values about to be written, inside the same atomic save.
    metadata[DIGEST_KEY] = digest(state, metadata)
    try:
      with _OrbaxErrorsQuiet():
        self._manager.save(
          int(round_index),
          args=ocp.args.StandardSave(
            state,
            save_args=jax.tree.map(
              lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), state
            ),
          ),
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
    checkpoint saved without metadata, as older versions saved them, or
    whose metadata does not read), its digest and round left out."""
    try:
      found = self._read_metadata(round_index)
    except _Damaged:
      return {}
    found.pop(DIGEST_KEY, None)
    found.pop(ROUND_KEY, None)
    return found

  def _read_metadata(self, round_index: int) -> dict[str, Any]:
    """The metadata saved with checkpoint `round_index`, digest included.

    Raises:
      _Damaged: orbax's metadata file of the checkpoint is missing or is
        not what orbax writes (orbax itself reads such a file as empty),
        or holds a key that orbax does not write.
    """
    path = os.path.join(self._step_path(int(round_index)), _STEP_METADATA)
    try:
      found = jsonfile.load(path, MAX_METADATA_BYTES, top=None)
    except jsonfile.JsonFileError as e:
      raise _Damaged(f'{path} does not read: {e.reason}') from None
    custom = found.get('custom_metadata') if isinstance(found, dict) else None
    if not isinstance(found, dict) or not isinstance(custom or {}, dict):
      raise _Damaged(f'{path} is not a checkpoint metadata file')
    fields = {f.name for f in dataclasses.fields(ocp.metadata.StepMetadata)}
    unknown = sorted(set(found) - fields)
    if unknown:
      raise _Damaged(f'{path} holds a key that orbax does not write: {unknown}')
    return dict(custom or {})

  def restore(self, round_index: int, like: Any) -> Any:
    """Restores the checkpoint `round_index` into the structure of `like`
    (None: the structure saved, as numpy arrays; not verified: see
    `restore_verified`)."""
    _ignore_closed_loop_callbacks()
    args = ocp.args.StandardRestore()
    if like is not None:
      abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
      args = ocp.args.StandardRestore(abstract)
    with _OrbaxErrorsQuiet(logging.WARNING):
      return self._manager.restore(int(round_index), args=args)

  def restore_verified(
    self, round_index: int, like: Any
  ) -> tuple[Any, dict[str, Any], bool]:
    """`(state, metadata, verified)` of checkpoint `round_index`: the state
    checked against the digest saved with it (`verified`; a checkpoint
    made before digests has none and is taken as it reads).

    Raises:
      _Damaged: the metadata does not read, or the state does not match
        its digest, or there is no digest but keys that only checkpoints
        with one have.
      Exception: what orbax raises for arrays that do not read.
    """
    meta = self._read_metadata(round_index)
    state = self.restore(round_index, like)
    expected = meta.pop(DIGEST_KEY, None)
    if expected is None and set(meta) - _BEFORE_DIGESTS:
      raise _Damaged(
        f'its metadata has no {DIGEST_KEY} digest but keys that only '
        f'checkpoints with one have: {sorted(set(meta) - _BEFORE_DIGESTS)}'
      )
    if expected is not None and digest(state, meta) != expected:
      raise _Damaged(
        f'its arrays or metadata do not match their {DIGEST_KEY} digest'
      )
    saved = meta.pop(ROUND_KEY, round_index)
    if saved != round_index:
      raise _Damaged(
        f'it holds the state after round {saved}, not {round_index}: a copy '
        'or a roll back in the wrong folder'
      )
    return state, meta, expected is not None

  def close(self) -> None:
    self._manager.close()
