"""All file access of the energy module goes through a `SysfsRoot`.

Paths are relative to the root ('sys/devices/system/cpu/...'), so tests point
the root at a temporary directory holding a fake Jetson tree, and a real run
uses '/'.
"""

import os
import pathlib
from typing import Sequence


class EnergyError(Exception):
  """Base class of the errors raised by `fedjax_mr.energy`."""


class SysfsRoot:
  """Reads and writes sysfs-like files below a root directory.

  Subclasses may override `write` (the test suite's kernel emulator does) to
  check values and update derived files as the kernel would.
  """

  def __init__(self, root: str | os.PathLike[str] = '/'):
    self.root = pathlib.Path(root)

  def __repr__(self) -> str:
    return f'SysfsRoot({str(self.root)!r})'

  def path(self, rel: str) -> pathlib.Path:
    """Returns the absolute path of `rel` below the root."""
    return self.root / rel.lstrip('/')

  def exists(self, rel: str) -> bool:
    return self.path(rel).exists()

  def is_dir(self, rel: str) -> bool:
    return self.path(rel).is_dir()

  def glob(self, pattern: str) -> list[str]:
    """Sorted relative paths matching a glob pattern (symlinks followed)."""
    return sorted(
      str(p.relative_to(self.root)) for p in self.root.glob(pattern)
    )

  def read(self, rel: str) -> str:
    """Returns the file's text without surrounding blanks and NULs.

    Device-tree strings end with a NUL, sysfs values with a newline.
    """
    with open(self.path(rel), 'rb') as f:
      data = f.read()
    return data.decode('utf-8', 'replace').strip().strip('\x00').strip()

  def read_int(self, rel: str) -> int:
    return int(self.read(rel))

  def read_words(self, rel: str) -> tuple[str, ...]:
    return tuple(self.read(rel).split())

  def read_ints(self, rel: str) -> tuple[int, ...]:
    return tuple(int(w) for w in self.read_words(rel))

  def try_read(self, rel: str) -> str | None:
    """Like `read`, but None when missing or not readable (e.g. debugfs)."""
    try:
      return self.read(rel)
    except OSError:
      return None

  def write(self, rel: str, value: int | str) -> None:
    """Writes `value` in one unbuffered write, as `echo value > file` does.

    Unbuffered, so the kernel's answer (EINVAL, EACCES, ...) surfaces here as
    an `OSError` instead of at close.
    """
    with open(self.path(rel), 'wb', buffering=0) as f:
      f.write(str(value).encode())


def join(*parts: str) -> str:
  """Joins relative sysfs path parts with '/'."""
  return '/'.join(p.strip('/') for p in parts if p)


def format_list(values: Sequence[int]) -> str:
  """'1,2,3' for short lists, 'first..last (n values)' for long ones."""
  if len(values) <= 4:
    return ','.join(str(v) for v in values)
  return f'{values[0]}..{values[-1]} ({len(values)} values)'
