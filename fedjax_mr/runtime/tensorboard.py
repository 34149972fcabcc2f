"""TensorBoard event files of a run's metrics rows, without TensorFlow.

The events are built with tensorboardX's protocol buffers and record
writer, written synchronously (each round's event is flushed and fsynced
before the round's checkpoint, and a failed write is an `OSError` naming
the file in the run's own thread, as for every other file of a workdir).
A resumed run starts a new event file with a "session start" at the first
round it runs again, which makes TensorBoard drop the earlier file's events
from that round on: the rounds past the checkpoint appear once, as in
`metrics.jsonl`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Any
from typing import Mapping

# The workdir's folder of event files (TensorBoard's logdir: the workdir).
FOLDER = 'tensorboard'


class EventWriter:
  """Appends scalar events to a new event file in `folder`."""

  def __init__(self, folder: str, purge_step: int | None = None):
    """Opens the file (and `folder`) and writes the file header.

    Args:
      folder: where the event file goes (created if missing).
      purge_step: if set, TensorBoard drops the events of earlier files of
        `folder` at this step and after (the rounds a resumed run redoes).
    """
    from tensorboardX import record_writer
    from tensorboardX.proto import event_pb2

    self._event_pb2 = event_pb2
    os.makedirs(folder, exist_ok=True)
    now = time.time()
    # Names sort in the order the files were started (TensorBoard reads a
    # folder's files in name order): seconds, then microseconds.
    micro = int(now % 1 * 1e6)
    self.path = os.path.join(
      folder,
      f'events.out.tfevents.{int(now)}.{micro:06d}.{socket.gethostname()}.'
      f'{os.getpid()}',
    )
    try:
      self._writer = record_writer.RecordWriter(self.path)
    except OSError as e:
      raise OSError(e.errno, e.strerror, self.path) from None
    self._write(event_pb2.Event(wall_time=now, file_version='brain.Event:2'))
    if purge_step is not None:
      start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
      self._write(
        event_pb2.Event(wall_time=now, step=purge_step, session_log=start)
      )
    self._flush()

  def _write(self, event: Any) -> None:
    try:
      self._writer.write(event.SerializeToString())
    except OSError as e:
      raise OSError(e.errno, e.strerror, self.path) from None

  def _flush(self) -> None:
    try:
      self._writer.flush()
    except OSError as e:
      raise OSError(e.errno, e.strerror, self.path) from None

  def scalars(self, step: int, row: Mapping[str, Any]) -> None:
    """Writes every number of `row` (a metrics row) as a scalar at `step`,
    tagged by its key; lists, strings, booleans and `round` are left out.
    Flushed and fsynced."""
    from tensorboardX.proto import summary_pb2

    values = [
      summary_pb2.Summary.Value(tag=key, simple_value=float(value))
      for key, value in row.items()
      if key != 'round'
      and isinstance(value, (int, float))
      and not isinstance(value, bool)
    ]
    event = self._event_pb2.Event(
      wall_time=time.time(),
      step=int(step),
      summary=summary_pb2.Summary(value=values),
    )
    self._write(event)
    self._flush()

  def close(self) -> None:
    """Closes the file. An error closing it loses nothing (every event
    was flushed and fsynced when written), so it is not raised: `close`
    runs on the way out of a run that may be failing for another reason."""
    with contextlib.suppress(OSError):
      self._writer.close()


def read_scalars(folder: str) -> dict[str, list[tuple[int, float]]]:
  """The scalars of every event file in `folder`, as TensorBoard shows
  them: `{tag: [(step, value), ...]}` in the order written, where a later
  file's session start at step s drops the events before it from step s
  on (without one, a step written twice appears twice). Record checksums
  are verified (`ValueError` if one does not match); a last record cut
  short is skipped."""
  import struct

  from tensorboardX.proto import event_pb2
  from tensorboardX.record_writer import masked_crc32c

  series: dict[str, list[tuple[int, float]]] = {}
  for name in sorted(n for n in os.listdir(folder) if 'tfevents' in n):
    with open(os.path.join(folder, name), 'rb') as f:
      data = f.read()
    pos = 0
    while pos + 16 <= len(data):
      header = data[pos : pos + 8]
      (length,) = struct.unpack('Q', header)
      (crc,) = struct.unpack('I', data[pos + 8 : pos + 12])
      if pos + 16 + length > len(data):
        break  # a record cut short by a crash: TensorBoard skips it too
      body = data[pos + 12 : pos + 12 + length]
      (body_crc,) = struct.unpack(
        'I', data[pos + 12 + length : pos + 16 + length]
      )
      if crc != masked_crc32c(header) or body_crc != masked_crc32c(body):
        raise ValueError(f'{name}: a record at byte {pos} is damaged')
      pos += 16 + length
      event = event_pb2.Event.FromString(body)
      if event.HasField('session_log'):
        if event.session_log.status == event_pb2.SessionLog.START:
          for tag, points in series.items():
            series[tag] = [p for p in points if p[0] < event.step]
        continue
      for value in event.summary.value:
        series.setdefault(value.tag, []).append(
          (event.step, value.simple_value)
        )
  return {tag: points for tag, points in series.items() if points}
