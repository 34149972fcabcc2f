"""Reading a JSON file the user gave: bounded, typed, every failure named.

    meta = jsonfile.load(path, max_bytes=1 << 20)          # a JSON object
    num_classes = jsonfile.field(meta, 'num_classes', int, path)
    shape = jsonfile.field(meta, 'input_shape', list, path)

`read_bytes` checks the file before reading it: a folder, a device, a FIFO
or a socket is refused by its type (a FIFO would block in `open`, a device
such as /dev/zero never ends), a file larger than `max_bytes` by its size.
`load` decodes it as UTF-8 JSON and checks the type at its top; `field`
and `check` check one value's type (a JSON `true` is not an integer, an
integer is a float). Every failure is a `JsonFileError`: one line,
'<path>: <reason>', its user content clipped (`errors.clip`); a caller
that speaks of an argument writes `f'{where}: {e.reason}'`.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any
from typing import Mapping

from fedjax_mr.core import errors

# A bound for files the library reads whole: far above any JSON file it
# writes (a config, a pool model's meta.json, a label map), far below
# what would exhaust memory while decoding.
MAX_BYTES = 1 << 26

_FILE_TYPES = (
  (stat.S_ISCHR, 'a character device'),
  (stat.S_ISBLK, 'a block device'),
  (stat.S_ISFIFO, 'a FIFO'),
  (stat.S_ISSOCK, 'a socket'),
)

# The JSON types by the Python type `json` decodes them to.
_NAMES = {
  dict: 'an object',
  list: 'a list',
  str: 'a string',
  int: 'an integer',
  float: 'a number',
  bool: 'true or false',
}


class JsonFileError(errors.DataError):
  """A JSON file that cannot be read, or holds the wrong thing: `str(e)`
  reads '<path>: <reason>'."""

  def __init__(self, path: str, reason: str):
    super().__init__(f'{errors.clip(path)}: {reason}')
    self.path = path
    self.reason = reason


def not_regular(mode: int) -> str | None:
  """Why a file of `os.stat` mode `mode` cannot be read whole ('is a
  folder', 'is not a regular file (a FIFO)'), or None for a regular
  file."""
  if stat.S_ISREG(mode):
    return None
  if stat.S_ISDIR(mode):
    return 'is a folder'
  kind = next((k for test, k in _FILE_TYPES if test(mode)), 'of no known kind')
  return f'is not a regular file ({kind})'


def read_bytes(path: str, max_bytes: int = MAX_BYTES) -> bytes:
  """The bytes of the regular file `path`, if it holds at most `max_bytes`.

  Checked before reading (`os.stat`): not a regular file, or larger than
  `max_bytes`; a file that grows meanwhile is read no further than
  `max_bytes + 1` bytes.

  Raises:
    JsonFileError: it cannot be read, is not a regular file, or is larger
      than `max_bytes`; the reason says which.
  """
  try:
    why = not_regular(os.stat(path).st_mode)
    if why:
      raise JsonFileError(path, why)
    with open(path, 'rb') as f:
      size = os.fstat(f.fileno()).st_size
      data = f.read(max_bytes + 1) if size <= max_bytes else b''
  except OSError as e:
    raise JsonFileError(path, f'cannot read it: {e.strerror or e}') from None
  if size > max_bytes or len(data) > max_bytes:
    size = max(size, len(data))
    raise JsonFileError(
      path, f'holds {size:,} bytes, more than the {max_bytes:,} allowed'
    )
  return data


def loads(
  data: bytes, path: str, top: type | tuple[type, ...] | None = dict
) -> Any:
  """`data`, the bytes of the file `path`, decoded as UTF-8 JSON whose top
  value is of type `top` (`dict`: an object; `list`; a tuple of them; None:
  any).

  Raises:
    JsonFileError: not UTF-8, not JSON, nested too deeply, or its top
      value of another type.
  """
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as e:
    raise JsonFileError(
      path, f'not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})'
    ) from None
  try:
    value = json.loads(text)
  except RecursionError:
    raise JsonFileError(path, 'not JSON (nested too deeply)') from None
  except ValueError as e:  # JSONDecodeError, or an integer too long
    raise JsonFileError(path, f'not JSON ({errors.clip(e)})') from None
  if top is not None and not _is(value, top):
    raise JsonFileError(path, f'holds {describe(value)}, not {_want(top)}')
  return value


def load(
  path: str,
  max_bytes: int = MAX_BYTES,
  top: type | tuple[type, ...] | None = dict,
) -> Any:
  """The JSON value in the file `path` (`read_bytes`, then `loads`).

  Raises:
    JsonFileError: see `read_bytes` and `loads`.
  """
  return loads(read_bytes(path, max_bytes), path, top)


def describe(value: Any) -> str:
  """`value` as its JSON type, quoted if short: 'the string "abc"',
  'a list', 'null', 'true'."""
  if value is None or isinstance(value, bool):
    return json.dumps(value)
  if isinstance(value, str):
    return f'the string {errors.clip(json.dumps(value), 40)}'
  if isinstance(value, (int, float)):
    return f'the number {errors.clip(value, 40)}'
  return _NAMES.get(type(value), type(value).__name__)


def check(
  value: Any, kind: type | tuple[type, ...], path: str, name: str
) -> Any:
  """`value` (what the file `path` holds at `name`) if it is of the JSON
  type `kind` (`int`, `float`, `str`, `bool`, `list`, `dict` or a tuple
  of them); `true`/`false` are not numbers, an integer is a `float`
  (returned as one).

  Raises:
    JsonFileError: `value` is of another type; the reason names `name`.
  """
  if not _is(value, kind):
    raise JsonFileError(path, f'{name} is {describe(value)}, not {_want(kind)}')
  if kind is float:
    return float(value)
  return value


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
  """Whether `value` is of the JSON type `kind` (see `check`)."""
  if isinstance(value, bool):
    return kind is bool or (isinstance(kind, tuple) and bool in kind)
  kinds = kind if isinstance(kind, tuple) else (kind,)
  return isinstance(value, kinds) or (float in kinds and isinstance(value, int))


def _want(kind: type | tuple[type, ...]) -> str:
  kinds = kind if isinstance(kind, tuple) else (kind,)
  return ' or '.join(_NAMES.get(k, k.__name__) for k in kinds)


_REQUIRED = object()


def field(
  obj: Mapping[str, Any],
  key: str,
  kind: type | tuple[type, ...],
  path: str,
  default: Any = _REQUIRED,
) -> Any:
  """`obj[key]`, a field of the JSON object that the file `path` holds,
  checked to be of type `kind` (see `check`); `default` if it is absent
  (or null) and a default is given.

  Raises:
    JsonFileError: `key` is absent without a default, or of another type;
      the reason names the field ('"num_classes" is the string "abc", not
      an integer').
  """
  name = f'"{errors.clip(key, 40)}"'
  value = obj.get(key)
  if value is None:
    if default is not _REQUIRED:
      return default
    if key not in obj:
      raise JsonFileError(path, f'has no {name} (want {_want(kind)})')
  return check(value, kind, path, name)
