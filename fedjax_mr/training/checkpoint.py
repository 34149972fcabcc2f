"""Atomic, keep-N checkpoints of the round state (orbax)."""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves and restores round states under `<workdir>/checkpoints/<round>`.

  Orbax writes each checkpoint to a temporary folder and renames it when
  complete, so a run killed while saving leaves the previous one intact.
  """

  def __init__(self, workdir: str, keep: int = 2):
    self._manager = ocp.CheckpointManager(
      os.path.abspath(os.path.join(workdir, 'checkpoints')),
      options=ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=False
      ),
    )

  def latest_round(self) -> int | None:
    """Rounds completed at the newest checkpoint, or None."""
    return self._manager.latest_step()

  def save(self, round_index: int, state: Any) -> None:
    """Saves `state` as the checkpoint after `round_index` rounds."""
    self._manager.save(
      int(round_index), args=ocp.args.StandardSave(state), force=True
    )
    self._manager.wait_until_finished()

  def restore(self, round_index: int, like: Any) -> Any:
    """Restores the checkpoint `round_index` into the structure of `like`."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    return self._manager.restore(
      int(round_index), args=ocp.args.StandardRestore(abstract)
    )

  def close(self) -> None:
    self._manager.close()
