"""Writing files so that a failure loses nothing and names the file.

`write_atomic` writes a whole file or nothing: a temporary file beside it,
flushed to disk, then renamed over the old one, so that a reader (a resumed
run, another process) sees the old file or the complete new one, and a full
disk or a kill mid-write leaves the old file as it was. Every `OSError`
raised here carries the path of the file it was about (`named`), so that a
program can report it in one line.
"""

from __future__ import annotations

import contextlib
import os
from typing import IO
from typing import Callable
from typing import Iterator


@contextlib.contextmanager
def named(path: str) -> Iterator[None]:
  """Re-raises an `OSError` without a file name as one about `path`."""
  try:
    yield
  except OSError as e:
    if e.filename:
      raise
    raise OSError(e.errno, e.strerror or str(e), path) from None


def write_atomic(
  path: str, write: Callable[[IO], None], binary: bool = False
) -> None:
  """Writes `path` whole or not at all: `write(f)` fills a temporary file
  that then replaces `path`.

  Raises:
    OSError: the file cannot be written (its `filename` is `path`); `path`
      is unchanged and the temporary file removed.
  """
  tmp = f'{path}.tmp.{os.getpid()}'
  try:
    with named(path):
      with open(tmp, 'wb' if binary else 'w') as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, path)
  finally:
    with contextlib.suppress(OSError):
      os.remove(tmp)


def append_line(path: str, line: str) -> None:
  """Appends `line` and a newline to `path`, flushed to disk. A failed
  append can leave a partial last line (readers drop it, see
  `metrics_io.read_checked`)."""
  with named(path), open(path, 'a') as f:
    f.write(line + '\n')
    f.flush()
    os.fsync(f.fileno())
