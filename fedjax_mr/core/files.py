"""Writing files so that a failure loses nothing and names the file.

`write_atomic` writes a whole file or nothing: a temporary file beside it,
flushed to disk, then renamed over the old one, so that a reader (a resumed
run, another process) sees the old file or the complete new one, and a full
disk or a kill mid-write leaves the old file as it was. Nothing is written
through a symbolic link: the temporary file is created anew (`O_EXCL`,
`O_NOFOLLOW`), the rename replaces a link at `path` rather than its target,
and `append_line` refuses a link (`O_NOFOLLOW`). Every `OSError`
raised here carries the path of the file it was about (`named`), so that a
program can report it in one line.
"""

from __future__ import annotations

import contextlib
import errno
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
  path: str,
  write: Callable[[IO], None],
  binary: bool = False,
  mode: int = 0o644,
) -> None:
  """Writes `path` whole or not at all: `write(f)` fills a temporary file
  (created with permissions `mode`) that then replaces `path`.

  Raises:
    OSError: the file cannot be written (its `filename` is `path`); `path`
      is unchanged and the temporary file removed.
  """
  tmp = f'{path}.tmp.{os.getpid()}'
  try:
    with named(path):
      with os.fdopen(_create_new(tmp, mode), 'wb' if binary else 'w') as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, path)
  finally:
    with contextlib.suppress(OSError):
      os.remove(tmp)


def _create_new(path: str, mode: int = 0o644) -> int:
  """A descriptor of `path` created anew for writing: a file left there (a
  temporary file of an earlier process of the same pid) is removed first,
  and a symbolic link there is removed, never followed."""
  flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
  try:
    return os.open(path, flags, mode)
  except FileExistsError:
    os.remove(path)
    return os.open(path, flags, mode)


def append_line(path: str, line: str) -> None:
  """Appends `line` and a newline to `path`, flushed to disk. A failed
  append can leave a partial last line (readers drop it, see
  `metrics_io.read_checked`).

  Raises:
    OSError: also when `path` is a symbolic link (`ELOOP`): a record is
      never appended to a file outside its folder.
  """
  flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
  with named(path):
    try:
      fd = os.open(path, flags, 0o644)
    except OSError as e:
      if e.errno != errno.ELOOP:
        raise
      raise OSError(
        e.errno, 'it is a symbolic link; a run appends only to its own file'
      ) from None
    with os.fdopen(fd, 'a') as f:
      f.write(line + '\n')
      f.flush()
      os.fsync(f.fileno())
