"""Errors that name the bad input; the experiment binaries print them as one
line and exit non-zero (no traceback)."""

import math
import os
import re


class UserError(ValueError):
  """Bad input from the user (a flag, a path, a config)."""


class ConfigError(UserError):
  """An invalid flag or configuration value."""


class DataError(UserError):
  """A dataset that is missing, unreadable or malformed."""


class StorageError(UserError):
  """A file that cannot be written: a full disk, a read-only place."""


def os_reason(error: BaseException) -> str | None:
  """The operating-system error behind `error` in words ('No space left on
  device'), or None if it is not one. Understands OSError and the errors
  that orbax/TensorStore raise for a failed write (they carry
  `os_error_code='28'` in their text)."""
  if isinstance(error, OSError) and error.strerror:
    return error.strerror
  found = re.search(r"os_error_code='?(\d+)", str(error))
  if found:
    return os.strerror(int(found.group(1)))
  return None


class NonFiniteError(RuntimeError):
  """Training produced a non-finite loss."""


class ArgumentError(ValueError):
  """A library function's bad argument, named: `str(e)` reads
  '<argument> <message>'. The experiment maps `argument` to its flag."""

  def __init__(self, argument: str, message: str):
    super().__init__(f'{argument} {message}')
    self.argument = argument
    self.message = message


def check_finite(name: str, value: float, positive: bool = False) -> None:
  """Raises `ArgumentError` naming `name` unless `value` is finite and > 0
  (`positive`) or >= 0."""
  ok = math.isfinite(value) and (value > 0 if positive else value >= 0)
  if not ok:
    raise ArgumentError(
      name, f'must be finite and {">" if positive else ">="} 0, got {value}'
    )


def check_count(name: str, value: int) -> int:
  """`value` as an int; raises `ArgumentError` naming `name` unless it is
  at least 1 (a number of clients, rounds, epochs, examples)."""
  count = int(value)
  if count < 1:
    raise ArgumentError(name, f'must be a positive integer, got {count}')
  return count


# What an error line may quote of the user's input (a path, a flag's value,
# a file's line): enough to recognise it, never a whole file.
CLIP_CHARS = 200


def clip(text: object, limit: int = CLIP_CHARS) -> str:
  """`text` fit for a one-line error: control characters (a newline, a
  terminal escape) written as escapes (`\\n`, `\\x1b`) and, past `limit`
  characters, cut with an ellipsis ('…')."""
  text = str(text)
  if len(text) > limit:
    text = text[:limit] + '…'
  return escape(text)


def escape(text: str) -> str:
  """`text` with its control characters (a newline in a folder's name, a
  terminal escape) written as escapes (`\\n`, `\\x1b`), so that a line
  that holds it stays one line."""
  return _CONTROL.sub(_escape, text)


_CONTROL = re.compile(r'[\x00-\x1f\x7f-\x9f]')
_ESCAPES = {'\n': '\\n', '\r': '\\r', '\t': '\\t'}


def _escape(match: re.Match) -> str:
  char = match.group(0)
  return _ESCAPES.get(char, f'\\x{ord(char):02x}')
