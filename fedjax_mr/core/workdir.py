"""One writer per output folder: an exclusive OS lock on `<folder>/.lock`.

The lock is `fcntl.flock` on an open file, so the kernel drops it when the
process ends in any way (exit, exception, `kill -9`): a killed run never
leaves a stale lock, and the next run of the same command resumes. The
file itself stays (it holds the holder's pid, for the message only); its
presence means nothing.

Programs take the lock after everything that can fail on bad input has
been checked and before writing anything (`acquire`); `check_free` asks
the same question earlier without creating a file, so a second run is
refused before it loads data.

flock locks are advisory and local to one machine: they do not protect a
folder on a network file system shared by two hosts.

A folder's files are its writer's own: the lock file is opened without
following a symbolic link and must be a regular file, and `check_entries`
refuses a symbolic link (or a file where a folder belongs) among the names
a program writes, so that nothing is ever written through a link to a
place outside the folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
from typing import Iterable

from fedjax_mr.core import errors

LOCK_FILE = '.lock'


class Lock:
  """A held lock; `release()` (or the end of the process) frees it."""

  def __init__(self, fd: int, path: str):
    self._fd = fd
    self.path = path

  def release(self) -> None:
    if self._fd is not None:
      os.close(self._fd)  # closing the descriptor drops the flock
      self._fd = None

  def __enter__(self) -> Lock:
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def _named(folder: str, name: str) -> str:
  """`folder` as a message names it, `name=folder` in backticks: `name` is
  the argument or config field that holds it."""
  return f'`{name}={errors.escape(folder)}`'


def _kind(mode: int) -> str:
  """What a file of `mode` (`os.lstat`) is, in words."""
  for test, what in (
    (stat.S_ISLNK, 'a symbolic link'),
    (stat.S_ISDIR, 'a folder'),
    (stat.S_ISREG, 'a file'),
    (stat.S_ISFIFO, 'a FIFO'),
    (stat.S_ISSOCK, 'a socket'),
    (stat.S_ISCHR, 'a character device'),
    (stat.S_ISBLK, 'a block device'),
  ):
    if test(mode):
      return what
  return 'not a regular file'


def check_entries(
  folder: str,
  files: Iterable[str] = (),
  folders: Iterable[str] = (),
  name: str = 'workdir',
) -> None:
  """Raises `ConfigError` if one of the `files` or `folders` (names inside
  `folder`) that a program writes exists as a symbolic link, or as
  something other than a regular file (`files`) or a folder (`folders`).

  Writing through a link would write outside `folder`; a file where a
  folder belongs would fail only when the first one is written (after a
  round's work). Creates nothing; a missing entry is fine.
  """
  wanted = [(f, stat.S_ISREG, 'a file') for f in files]
  wanted += [(f, stat.S_ISDIR, 'a folder') for f in folders]
  for entry, test, what in wanted:
    path = os.path.join(folder, entry)
    try:
      mode = os.lstat(path).st_mode
    except FileNotFoundError:
      continue
    except OSError as e:
      raise errors.ConfigError(
        f'{_named(folder, name)}: cannot read {errors.escape(path)} '
        f'({e.strerror})'
      ) from None
    if stat.S_ISLNK(mode):
      target = errors.escape(os.readlink(path))
      raise errors.ConfigError(
        f'{_named(folder, name)}: {entry} is a symbolic link (to {target}); '
        f'a run writes only its own files: remove the link, or pass another '
        f'`{name}`'
      )
    if not test(mode):
      raise errors.ConfigError(
        f'{_named(folder, name)}: {entry} is {_kind(mode)}, where the run '
        f'keeps {what}; move it away, or pass another `{name}`'
      )


def _busy(folder: str, name: str, fd: int) -> errors.ConfigError:
  try:
    holder = os.pread(fd, 32, 0).decode(errors='replace').strip()
  except OSError:
    holder = ''
  who = f' (pid {holder})' if holder.isdigit() else ''
  return errors.ConfigError(
    f'{_named(folder, name)} is in use by another running process{who}; '
    'wait for it to finish or choose another folder'
  )


def _check_utf8(folder: str, name: str) -> None:
  """Raises `ConfigError` if `folder`'s name is not valid UTF-8 (Python
  holds such bytes of a command line as lone surrogates). orbax and
  TensorStore take paths as UTF-8: the first checkpoint, and every
  resume, would fail after the work of a round."""
  try:
    folder.encode('utf-8')
  except UnicodeEncodeError:
    shown = os.fsencode(folder).decode('utf-8', 'backslashreplace')
    raise errors.ConfigError(
      f'{_named(shown, name)}: the name is not valid UTF-8, and checkpoints '
      'need UTF-8 paths; choose a UTF-8 name'
    ) from None


def check_usable(folder: str, name: str = 'workdir') -> None:
  """Raises `ConfigError` unless `folder` is, or can be made, a writable
  folder: not a file, not below a file, not on a read-only place or one
  that takes no files (/proc), with a name that is valid UTF-8.

  Leaves nothing behind (a probe file is made and removed at once in the
  nearest folder that exists); the message names `folder` as `name`
  (`acquire`).
  """
  _check_utf8(folder, name)
  where = _named(folder, name)
  existing = os.path.abspath(folder)
  while not os.path.exists(existing):
    parent = os.path.dirname(existing)
    if parent == existing:
      break
    existing = parent
  what = (
    'it' if existing == os.path.abspath(folder) else errors.escape(existing)
  )
  if not os.path.isdir(existing):
    raise errors.ConfigError(f'{where}: {what} is a file, not a folder')
  if not os.access(existing, os.W_OK | os.X_OK):
    raise errors.ConfigError(
      f'{where}: {what} is not writable (read-only or no permission)'
    )
  # `access` says yes to root for any folder of a read-write mount, /proc
  # and /sys included: a file made and removed at once is the real test.
  try:
    fd, probe = tempfile.mkstemp(dir=existing, prefix='.fedjax_mr-probe-')
  except OSError as e:
    raise errors.ConfigError(
      f'{where}: {what} does not take new files ({e.strerror})'
    ) from None
  os.close(fd)
  os.remove(probe)


def check_free(folder: str, name: str = 'workdir') -> None:
  """Raises `ConfigError` if `folder` cannot be written (`check_usable`),
  its lock file is not a regular file of its own (a link, a folder), or a
  live process holds its lock.

  Creates nothing (a folder without a lock file is free).
  """
  check_usable(folder, name)
  check_entries(folder, files=[LOCK_FILE], name=name)
  path = os.path.join(folder, LOCK_FILE)
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
  except OSError:
    return
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
      raise _busy(folder, name, fd) from None
    fcntl.flock(fd, fcntl.LOCK_UN)
  finally:
    os.close(fd)


def acquire(folder: str, name: str = 'workdir') -> Lock:
  """Creates `folder` if needed and takes its exclusive lock.

  Args:
    folder: the output folder.
    name: the argument or config field that names it, for the message
      (`workdir`, written `workdir=<folder>`).

  Returns:
    The held `Lock`; keep it for as long as the process writes `folder`.

  Raises:
    ConfigError: another live process holds the lock, or the folder
      cannot be created or locked (a file, a read-only place, ...).
  """
  _check_utf8(folder, name)
  path = os.path.join(folder, LOCK_FILE)
  try:
    os.makedirs(folder, exist_ok=True)
    check_entries(folder, files=[LOCK_FILE], name=name)
    # Not through a link that appeared since: the lock is the folder's own.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
  except OSError as e:
    raise errors.ConfigError(
      f'{_named(folder, name)}: cannot create or lock it ({e.strerror})'
    ) from None
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    os.close(fd)
    check_entries(folder, files=[LOCK_FILE], name=name)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    err = _busy(folder, name, fd)
    os.close(fd)
    raise err from None
  except OSError as e:
    os.close(fd)
    raise errors.ConfigError(
      f'{_named(folder, name)}: cannot lock it ({e.strerror})'
    ) from None
  # The holder's pid, for the message of a refused second process only: a
  # failure to write it changes nothing about the lock.
  with contextlib.suppress(OSError):
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
  return Lock(fd, path)
