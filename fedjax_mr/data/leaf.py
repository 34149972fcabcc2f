"""LEAF json datasets (FEMNIST, Shakespeare): the format, read and written.

LEAF's preprocessing (`preprocess.sh` in `leaf/data/<name>`) writes a
`train/` and a `test/` folder of json files, each::

  {"users": [u, ...], "num_samples": [n_u, ...],
   "user_data": {u: {"x": [...], "y": [...]}, ...}}

FEMNIST: `x` is a flattened 28×28 grey image (784 floats in [0, 1], LEAF
writes multiples of 1/255), `y` one of 62 classes. Shakespeare: `x` is a
string of 80 characters, `y` the next character; both are mapped to ids in
LEAF's 80-character vocabulary `ALL_LETTERS`.

Reading is two passes over the files: the first reads only the head of each
file (`users` and `num_samples` come before `user_data` in what LEAF
writes; any other file is parsed whole) to size the arrays, which are then
allocated once; the second parses one file at a time and fills them in
place. Peak host memory is therefore the final arrays plus one parsed file.

Writing (`femnist.convert`, `shakespeare.convert`) is what LEAF's own
scripts do (`data/utils/split_data.py` of github.com/TalwalkarLab/leaf),
as if `preprocess.sh` ran with `-s niid`, a sampling fraction (`sf`) of
1.0, `-k 0`, `-t sample` and a training fraction (`tf`) of 0.9: every user
is kept (the papers' filter, e.g. FEMNIST writers with more than 100
samples, is the loader's `leaf_min_samples`, which counts as LEAF's `-k`
does), and each user's samples are split into training and test at random
(`train_mask`: LEAF's `random.Random(seed).sample`, so a given `seed` gives
the split `split_data.py` would give with that seed on the same users in
the same order). Users are in sorted (FEMNIST) or text (Shakespeare)
order, not in the file system's order, and not shuffled by `sample.py`
(a sampling fraction of 1.0 keeps every user, only their order changes).

References:
  Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018.
"""

from __future__ import annotations

import glob
import json
import os
import random
from typing import Callable
from typing import Iterator
from typing import NamedTuple

import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.data import host

# LEAF's Shakespeare vocabulary; a character's id is its position.
ALL_LETTERS = (
  '\n !"&\'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrst'
  'uvwxyz}'
)
SEQ_LEN = 80
FEMNIST_SHAPE = (28, 28, 1)
# LEAF's default (`split_data.py`): 90 % of each user's samples train.
TRAIN_FRACTION = 0.9

_UNKNOWN = 255
_LUT = np.full(256, _UNKNOWN, np.uint8)
_LUT[np.frombuffer(ALL_LETTERS.encode('ascii'), np.uint8)] = np.arange(
  len(ALL_LETTERS), dtype=np.uint8
)


class LeafData(NamedTuple):
  """One LEAF dataset read into arrays.

  Attributes:
    x_train: `[M, ...]` uint8 examples, user after user.
    y_train: `[M]` int32 labels.
    clients: one index array into `x_train` per training user (in file
      order).
    x_test: `[M_test, ...]`.
    y_test: `[M_test]`.
    test_clients: per training user, its indices into `x_test` (empty for
      a user without test data), when every test user is a training user
      (LEAF's `-t sample` split); None when the test split holds other
      users (`-t user`).
  """

  x_train: np.ndarray
  y_train: np.ndarray
  clients: tuple[np.ndarray, ...]
  x_test: np.ndarray
  y_test: np.ndarray
  test_clients: tuple[np.ndarray, ...] | None


class _Format(NamedTuple):
  shape: tuple[int, ...]  # one example
  convert_x: Callable[[list, str], np.ndarray]  # (json x, where) -> uint8
  convert_y: Callable[[list, str], np.ndarray]  # (json y, where) -> int32


def split_dir(data_dir: str, split: str) -> str | None:
  """`<data_dir>/<split>` or `<data_dir>/data/<split>` (LEAF's layout)."""
  for folder in (
    os.path.join(data_dir, split),
    os.path.join(data_dir, 'data', split),
  ):
    if glob.glob(os.path.join(folder, '*.json')):
      return folder
  return None


def load_femnist(data_dir: str, min_samples: int = 0) -> LeafData:
  """FEMNIST from LEAF json; pixels stored as uint8 `round(255 · x)`.

  Args:
    data_dir: holds `train/` and `test/` (or `data/train`, `data/test`).
    min_samples: keep only writers with more than this many samples
      (training plus test, as LEAF's `-k` counts before its split).
  """
  return _load(data_dir, min_samples, _Format(FEMNIST_SHAPE, _pixels, _ints))


def load_shakespeare(data_dir: str, min_samples: int = 0) -> LeafData:
  """Shakespeare from LEAF json: `x` `[M, 80]` uint8 character ids, `y`
  `[M]` the id of the next character.

  Args:
    data_dir: see `load_femnist`.
    min_samples: keep only roles with more than this many samples.
  """
  fmt = _Format((SEQ_LEN,), _strings_to_ids, _chars_to_ids)
  return _load(data_dir, min_samples, fmt)


def _load(data_dir: str, min_samples: int, fmt: _Format) -> LeafData:
  folders = {}
  for split in ('train', 'test'):
    folders[split] = split_dir(data_dir, split)
    if folders[split] is None:
      raise errors.DataError(
        f'`data_dir`: no LEAF json files in {data_dir!r}/{split} (nor '
        f'{data_dir!r}/data/{split})'
      )
  files = {
    s: sorted(glob.glob(os.path.join(f, '*.json'))) for s, f in folders.items()
  }
  counts = {s: _counts(fs) for s, fs in files.items()}
  totals: dict[str, int] = {}
  for split_counts in counts.values():
    for user, n in split_counts.items():
      totals[user] = totals.get(user, 0) + n
  keep = {u for u, n in totals.items() if n > min_samples}
  train_users = [u for u in counts['train'] if u in keep]
  test_users = [u for u in counts['test'] if u in keep]
  if not train_users:
    raise errors.DataError(
      f'{folders["train"]}: no user has more than {min_samples} samples'
    )
  x_train, y_train, train_rows = _fill(
    files['train'], train_users, counts['train'], fmt
  )
  x_test, y_test, test_rows = _fill(
    files['test'], test_users, counts['test'], fmt
  )
  clients = tuple(train_rows[u] for u in train_users)
  test_clients = None
  if set(test_users) <= set(train_users):
    empty = np.zeros((0,), np.int64)
    test_clients = tuple(test_rows.get(u, empty) for u in train_users)
  return LeafData(x_train, y_train, clients, x_test, y_test, test_clients)


def _counts(files: list[str]) -> dict[str, int]:
  """User → number of samples over `files`, in file order."""
  out: dict[str, int] = {}
  for path in files:
    users, num_samples = _head(path)
    if len(users) != len(num_samples):
      raise errors.DataError(
        f'{path}: {len(users)} users but {len(num_samples)} num_samples'
      )
    for u, n in zip(users, num_samples):
      if u in out:
        raise errors.DataError(f'{path}: user {u!r} appears twice')
      out[u] = int(n)
  return out


def _head(path: str) -> tuple[list, list]:
  """`users` and `num_samples` of a LEAF file, read from its head when they
  come before `user_data` (as LEAF writes them), else from the whole file."""
  buf = b''
  pos = -1
  with open(path, 'rb') as f:
    while pos < 0:
      chunk = f.read(1 << 20)
      if not chunk:
        break
      buf += chunk
      pos = buf.find(b'"user_data"')
  if pos >= 0:
    try:
      head = json.loads(buf[:pos].rstrip().rstrip(b',') + b'}')
    except ValueError:
      head = {}
    if 'users' in head and 'num_samples' in head:
      return head['users'], head['num_samples']
  data = _read_json(path)
  return data['users'], data['num_samples']


def _read_json(path: str) -> dict:
  try:
    with open(path, 'rb') as f:
      data = json.load(f)
  except (OSError, ValueError) as e:
    raise errors.DataError(f'{path}: not a readable LEAF json file ({e})')
  if not all(k in data for k in ('users', 'num_samples', 'user_data')):
    raise errors.DataError(
      f'{path}: a LEAF json file needs "users", "num_samples" and "user_data"'
    )
  return data


def _fill(
  files: list[str],
  users: list[str],
  counts: dict[str, int],
  fmt: _Format,
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
  """Allocates the arrays for `users` once and fills them file by file."""
  start, pos = {}, 0
  for u in users:
    start[u] = pos
    pos += counts[u]
  x = host.empty((pos, *fmt.shape), np.uint8)
  y = np.empty((pos,), np.int32)
  wanted = set(users)
  for path in files:
    user_data = _read_json(path)['user_data']
    for u in wanted.intersection(user_data):
      where = f'{path}: user {u!r}'
      xs, ys = user_data[u]['x'], user_data[u]['y']
      n = counts[u]
      if len(xs) != n or len(ys) != n:
        raise errors.DataError(
          f'{where}: num_samples says {n}, user_data has {len(xs)} x and '
          f'{len(ys)} y'
        )
      if n == 0:
        continue
      a = start[u]
      x[a : a + n] = fmt.convert_x(xs, where).reshape(n, *fmt.shape)
      y[a : a + n] = fmt.convert_y(ys, where)
    del user_data
  rows = {u: np.arange(start[u], start[u] + counts[u]) for u in users}
  return x, y, rows


def _pixels(xs: list, where: str) -> np.ndarray:
  size = int(np.prod(FEMNIST_SHAPE))
  try:
    a = np.asarray(xs, np.float32)
  except (TypeError, ValueError):  # ragged or not numbers
    raise errors.DataError(
      f'{where}: FEMNIST x must be lists of {size} numbers'
    ) from None
  if a.ndim != 2 or a.shape[1] != size:
    raise errors.DataError(
      f'{where}: FEMNIST x must be lists of {size} pixels, got shape {a.shape}'
    )
  if a.size and not (a.min() >= 0.0 and a.max() <= 1.0):
    raise errors.DataError(f'{where}: FEMNIST pixels must lie in [0, 1]')
  return np.rint(a * 255).astype(np.uint8)


def _ints(ys: list, where: str) -> np.ndarray:
  try:
    a = np.asarray(ys)
  except (TypeError, ValueError):
    raise errors.DataError(f'{where}: labels must be integers') from None
  if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
    raise errors.DataError(f'{where}: labels must be integers')
  return a.astype(np.int32)


def _ids(text: str, where: str) -> np.ndarray:
  try:
    raw = np.frombuffer(text.encode('ascii'), np.uint8)
  except UnicodeEncodeError:
    raw = np.frombuffer(text.encode('utf-8'), np.uint8)
  ids = _LUT[raw]
  if (ids == _UNKNOWN).any():
    bad = sorted(set(text) - set(ALL_LETTERS))
    raise errors.DataError(
      f'{where}: characters outside the 80-letter vocabulary: {bad!r}'
    )
  return ids


def _strings_to_ids(xs: list, where: str) -> np.ndarray:
  if any(not isinstance(s, str) or len(s) != SEQ_LEN for s in xs):
    raise errors.DataError(
      f'{where}: Shakespeare x must be strings of {SEQ_LEN} characters'
    )
  return _ids(''.join(xs), where)


def _chars_to_ids(ys: list, where: str) -> np.ndarray:
  if any(not isinstance(s, str) or len(s) != 1 for s in ys):
    raise errors.DataError(f'{where}: Shakespeare y must be single characters')
  return _ids(''.join(ys), where).astype(np.int32)


# ------------------------------------------------------------------ writing --


def train_mask(
  n: int, fraction: float, rng: random.Random
) -> np.ndarray | None:
  """LEAF's `split_data.py` by sample, for one user of `n` samples.

  Returns:
    `[n]` bool, True for the training samples: `max(1, int(fraction · n))`
    of them (1 of 2), drawn with `rng.sample` as LEAF draws them; None for
    a user with fewer than 2 samples, which LEAF drops.
  """
  if n < 2:
    return None
  k = 1 if n == 2 else max(1, int(fraction * n))
  mask = np.zeros(n, bool)
  mask[rng.sample(range(n), k)] = True
  return mask


def write_json(
  path: str,
  users: list[str],
  num_samples: list[int],
  user_data: Iterator[tuple[str, str, str]],
) -> None:
  """Writes a LEAF json file, `users` and `num_samples` first (as LEAF
  does, so the loader sizes its arrays from the head). `user_data` yields
  (user, x as json text, y as json text) in the order of `users`."""
  with open(path, 'w', encoding='utf-8') as f:
    f.write(f'{{"users": {json.dumps(users)}, ')
    f.write(f'"num_samples": {json.dumps(num_samples)}, "user_data": {{')
    for i, (user, x, y) in enumerate(user_data):
      if user != users[i]:
        raise AssertionError(f'user {user!r} out of order')
      f.write(f'{", " if i else ""}{json.dumps(user)}: ')
      f.write(f'{{"x": {x}, "y": {y}}}')
    f.write('}}')
