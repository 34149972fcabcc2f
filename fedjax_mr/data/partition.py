"""Splitting a training set among simulated clients (host side, seeded).

Every partition is a list of client index arrays into the training set:
`iid`, `dirichlet`, `dirichlet_equal` and `shards` draw one from a seed
(`drawn`: any of them by name), `sizes_between` clients of uniform sizes
in a range (the benchmark's large cohorts); `load_file` reads one
(`read_file` then `parse_file`), `save_file` writes one in that format.
Errors are `ArgumentError`s naming the argument at fault.

References:
  Dirichlet label skew as in NIID-Bench (Li et al., "Federated Learning on
  Non-IID Data Silos: An Experimental Study", ICDE 2022) and MOON, which the
  FedMR and FedMut reference code use. Shards: McMahan et al.,
  "Communication-Efficient Learning of Deep Networks from Decentralized
  Data", AISTATS 2017 (the pathological non-IID split).
"""

from __future__ import annotations

import hashlib
import json
from typing import Sequence

import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.core import files
from fedjax_mr.core import jsonfile


def iid(num_examples: int, num_clients: int, seed: int) -> list[np.ndarray]:
  """Equal-size random split (sizes differ by at most one).

  Returns:
    `num_clients` int64 index arrays, disjoint, covering `range(num_examples)`.
  """
  _check_counts(num_examples, num_clients, 1)
  perm = np.random.default_rng(seed).permutation(num_examples)
  return [np.sort(p) for p in np.array_split(perm, num_clients)]


def sizes_between(
  num_examples: int, num_clients: int, low: int, high: int, seed: int
) -> list[np.ndarray]:
  """Clients of uniformly drawn sizes in `[low, high]` (examples at random).

  Each client's size is drawn uniformly from `low..high`, its examples
  without replacement from one permutation of the set (disjoint clients);
  labels play no part. The benchmark's large cohorts ("clients of 10-50
  examples").

  Returns:
    `num_clients` sorted int64 index arrays, disjoint.

  Raises:
    ArgumentError: naming `low` (below 1 or above `high`) or `num_clients`
      (`num_clients × high` more than `num_examples`), before drawing.
  """
  if not 1 <= low <= high:
    raise errors.ArgumentError(
      'low', f'must be in [1, high], got low={low}, high={high}'
    )
  _check_counts(num_examples, num_clients, high)
  rng = np.random.default_rng(seed)
  sizes = rng.integers(low, high + 1, num_clients)
  perm = rng.permutation(num_examples)[: sizes.sum()]
  return [np.sort(p) for p in np.split(perm, np.cumsum(sizes)[:-1])]


def check_alpha(alpha: float) -> None:
  """Raises `ArgumentError` naming `alpha` unless it is a Dirichlet
  concentration: finite and > 0."""
  errors.check_finite('alpha', alpha, positive=True)


def dirichlet(
  labels: np.ndarray,
  num_clients: int,
  alpha: float,
  seed: int,
  min_size: int = 10,
  max_tries: int = 10_000,
) -> list[np.ndarray]:
  """Dirichlet(α) label-skew partition.

  Repeats, until every client holds at least `min_size` examples: for each
  class, shuffle its indices, draw client proportions p ~ Dir(α·1), zero the
  share of clients that already hold ≥ M/N examples, renormalise and split
  the class's indices at the cumulative proportions. Each client's list is
  shuffled at the end. Small α gives few classes per client; large α tends
  to IID.

  Args:
    labels: `[M]` integer labels.
    num_clients: N.
    alpha: concentration, > 0.
    seed: numpy seed.
    min_size: minimum examples per client.
    max_tries: attempts before giving up with an error.

  Returns:
    `num_clients` index arrays, disjoint and covering `range(M)`.

  Raises:
    ArgumentError: naming `alpha` (not > 0, or no split found in
      `max_tries`) or `num_clients` (fewer than `min_size` examples each).
  """
  labels = np.asarray(labels)
  check_alpha(alpha)
  _check_counts(len(labels), num_clients, min_size)
  rng = np.random.default_rng(seed)
  m = len(labels)
  cap = m / num_clients
  classes = np.unique(labels)
  by_class = [np.flatnonzero(labels == c) for c in classes]
  for _ in range(max_tries):
    # Per class: the shuffled indices and, for each, the client it goes to
    # (client j gets the j-th contiguous run of the class's indices).
    idx_runs, owner_runs = [], []
    sizes = np.zeros(num_clients, np.int64)
    for members in by_class:
      idx = members.copy()
      rng.shuffle(idx)
      p = rng.dirichlet(np.full(num_clients, alpha))
      p = np.where(sizes < cap, p, 0.0)
      if not p.sum() > 0:
        # A very small alpha puts all the mass (or, underflowing, none) on
        # clients that are already full: this try fails.
        sizes[:] = 0
        break
      p = p / p.sum()
      cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
      counts = np.diff(np.concatenate([[0], cuts, [len(idx)]]))
      idx_runs.append(idx)
      owner_runs.append(np.repeat(np.arange(num_clients), counts))
      sizes += counts
    if sizes.min() >= min_size:
      idx, owner = np.concatenate(idx_runs), np.concatenate(owner_runs)
      # Stable: each client's examples in the order they were dealt.
      order = np.argsort(owner, kind='stable')
      parts = np.split(idx[order].astype(np.int64), np.cumsum(sizes)[:-1])
      out = []
      for q in parts:
        q = q.copy()
        rng.shuffle(q)
        out.append(q)
      return out
  raise errors.ArgumentError(
    'alpha',
    f'no split with ≥ {min_size} examples per client after {max_tries} '
    f'tries (alpha={alpha}, {num_clients} clients); use fewer clients or a '
    'larger `alpha`',
  )


def dirichlet_equal(
  labels: np.ndarray, num_clients: int, alpha: float, seed: int
) -> list[np.ndarray]:
  """Equal-size clients whose class proportions are drawn from Dir(α).

  FedStitch's non-IID setting (§III: devices "with the same amount of
  training data", each client's number of examples per class from a
  Dirichlet distribution), the per-client scheme of Hsu, Qi and Brown
  ("Measuring the Effects of Non-Identical Data Distribution for Federated
  Visual Classification", 2019); `dirichlet` instead splits each class
  over the clients, which leaves clients nearly empty when there are few
  classes and α is small (5 classes, 100 clients, α = 0.1).

  Client k (in order) gets ⌊M/N⌋ or ⌈M/N⌉ examples (the first M mod N get
  one more): it draws q_k ~ Dir(α·1_C) and takes a multinomial draw of
  its size over the classes by q_k, capped at what each class has left,
  redrawing the shortfall over the classes that still have examples (by
  q_k, or evenly when q_k's classes are used up), so every example is
  used once; the last clients therefore hold what the others left, as in
  any exact-size version of this scheme. Within a class, examples are
  taken in a seeded random order.

  Returns:
    `num_clients` sorted int64 index arrays, disjoint, covering `range(M)`.
  """
  labels = np.asarray(labels)
  check_alpha(alpha)
  _check_counts(len(labels), num_clients, 1)
  rng = np.random.default_rng(seed)
  classes = np.unique(labels)
  pools = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
  left = np.array([len(p) for p in pools], np.int64)
  used = np.zeros(len(classes), np.int64)
  base, extra = divmod(len(labels), num_clients)
  out = []
  for k in range(num_clients):
    need = base + (k < extra)
    q = rng.dirichlet(np.full(len(classes), alpha))
    take = np.zeros(len(classes), np.int64)
    while need > 0:
      avail = left - take
      w = np.where(avail > 0, q, 0.0)
      if w.sum() <= 0:
        w = (avail > 0).astype(np.float64)
      draw = np.minimum(rng.multinomial(need, w / w.sum()), avail)
      take += draw
      need -= int(draw.sum())
    rows = [p[u : u + t] for p, u, t in zip(pools, used, take)]
    out.append(np.sort(np.concatenate(rows)).astype(np.int64))
    used += take
    left -= take
  return out


def shards(
  labels: np.ndarray, num_clients: int, shards_per_client: int, seed: int
) -> list[np.ndarray]:
  """Label-sorted shards dealt at random (the FedAvg paper's pathological
  non-IID split).

  The M examples are sorted by label, stably (a class's examples keep their
  dataset order), and cut into S = N·s shards of consecutive examples. When
  S does not divide M the sizes differ by at most one: the first M mod S
  shards in that order hold ⌈M/S⌉ examples, the others ⌊M/S⌋, so every
  example is used once. A seeded permutation `perm` of the shards deals
  them: client j gets shards `perm[j·s : (j+1)·s]`, so client sizes differ
  by at most s.

  Classes per client: a shard holds one class unless a class boundary falls
  inside it. When S divides M and every class's size is a multiple of M/S
  (Fashion-MNIST's 6,000 per class with N=100, s=2: shards of 300), no shard
  straddles, and a client holds at most s classes: exactly s unless it
  draws two shards of one class, as in the paper. Otherwise a straddling
  shard holds two classes (more only if a class has fewer than ⌈M/S⌉
  examples), so a client holds at most 2s. `summary` reports the outcome.

  Args:
    labels: `[M]` integer labels.
    num_clients: N.
    shards_per_client: s, ≥ 1.
    seed: numpy seed (only the deal is random).

  Returns:
    `num_clients` sorted int64 index arrays, disjoint, covering `range(M)`.

  Raises:
    ArgumentError: naming `shards_per_client` (below 1) or `num_clients`
      (more shards than examples).

  References:
    McMahan et al., "Communication-Efficient Learning of Deep Networks from
    Decentralized Data", AISTATS 2017, Section 3 (N=100, s=2 on MNIST).
  """
  labels = np.asarray(labels)
  errors.check_count('shards_per_client', shards_per_client)
  _check_counts(len(labels), num_clients, 1)
  total = num_clients * shards_per_client
  if total > len(labels):
    raise errors.ArgumentError(
      'num_clients',
      f'× `shards_per_client={shards_per_client}` = {total} shards of at '
      f'least one example need {total} examples; the dataset has '
      f'{len(labels)}',
    )
  pieces = np.array_split(np.argsort(labels, kind='stable'), total)
  perm = np.random.default_rng(seed).permutation(total)
  deals = perm.reshape(num_clients, shards_per_client)
  return [
    np.sort(np.concatenate([pieces[i] for i in deal])).astype(np.int64)
    for deal in deals
  ]


# Client index rows are int32 on the device (`client_data`).
_MAX_INDEX = 2**31 - 1


# A partition file lists each training example at most once. The largest
# training set here (Shakespeare, 3.8 M examples) written one index per
# line with indentation takes about 55 MiB; beyond 128 MiB a file is not a
# partition, and reading it would cost its size again in Python ints
# (json holds ~1 GB for a full 128 MiB of small indices).
MAX_FILE_BYTES = 2**27


class FileError(errors.ArgumentError):
  """A partition file that cannot be used: `str(e)` reads
  'path <path>: <reason>'; `reason` says what is wrong with it."""

  def __init__(self, path: str, reason: str):
    super().__init__('path', f'{errors.clip(path)}: {reason}')
    self.reason = reason


DRAWN = ('iid', 'shards', 'dirichlet_equal', 'dirichlet')


def drawn(
  kind: str,
  labels: np.ndarray,
  num_clients: int,
  seed: int,
  *,
  alpha: float = 0.5,
  shards_per_client: int = 2,
  min_size: int = 10,
) -> list[np.ndarray]:
  """The partition of kind `kind` (one of `DRAWN`) of the examples with
  `labels`, drawn from `seed`: `iid`, `shards` (`shards_per_client`),
  `dirichlet_equal` (`alpha`) or `dirichlet` (`alpha`, `min_size`).

  Raises:
    ArgumentError: naming the argument at fault.
  """
  if kind == 'iid':
    return iid(len(labels), num_clients, seed)
  if kind == 'shards':
    return shards(labels, num_clients, shards_per_client, seed)
  if kind == 'dirichlet_equal':
    return dirichlet_equal(labels, num_clients, alpha, seed)
  if kind == 'dirichlet':
    return dirichlet(labels, num_clients, alpha, seed, min_size=min_size)
  raise errors.ArgumentError('kind', f'{kind!r} is none of {", ".join(DRAWN)}')


def read_file(path: str) -> bytes:
  """The bytes of a partition file, the one place they are read.

  Raises:
    FileError: it cannot be read, or it is not a regular file of at most
      `MAX_FILE_BYTES`.
  """
  try:
    return jsonfile.read_bytes(path, MAX_FILE_BYTES)
  except jsonfile.JsonFileError as e:
    raise FileError(
      path,
      f'{e.reason} (a partition file is a regular JSON file of at most '
      f'{MAX_FILE_BYTES >> 20} MiB: it lists each training example at most '
      'once)',
    ) from None


def digest(data: bytes) -> str:
  """The sha256 (hex) of a partition file's bytes (what a run keeps)."""
  return hashlib.sha256(data).hexdigest()


def file_sha256(path: str) -> str:
  """The sha256 (hex) of a partition file's bytes.

  Raises:
    OSError: the file cannot be read, or it is not a regular file of at
      most `MAX_FILE_BYTES` (`read_file` says which).
  """
  try:
    return digest(read_file(path))
  except FileError as e:
    raise OSError(f'{errors.clip(path)}: {e.reason}') from None


def save_file(path: str, parts: Sequence[np.ndarray]) -> None:
  """Writes client index lists as `load_file` reads them,
  `{"clients": [[i, ...], ...]}`, atomically.

  Raises:
    OSError: the file cannot be written.
  """
  clients = [[int(i) for i in np.asarray(p)] for p in parts]
  files.write_atomic(path, lambda f: json.dump({'clients': clients}, f))


def load_file(
  path: str, num_clients: int, num_examples: int | None = None
) -> tuple[list[np.ndarray], str]:
  """Reads a partition file and checks it: `parse_file` of `read_file`.

  Returns:
    The `num_clients` int64 index arrays and the sha256 (hex) of the file.

  Raises:
    FileError: as `read_file` and `parse_file`.
  """
  data = read_file(path)
  return parse_file(data, path, num_clients, num_examples), digest(data)


def parse_file(
  data: bytes, path: str, num_clients: int, num_examples: int | None = None
) -> list[np.ndarray]:
  """The client index lists of a partition file's bytes `data`, checked.

  The file is JSON: a list with one list of training-example indices per
  client, or an object whose "clients" key holds that list (what
  `save_file` writes). It must hold exactly `num_clients` clients, each
  with at least one index; an index is an integer in `[0, num_examples)`
  and belongs to at most one client, once. Examples in no client are left
  out of training. Each client keeps its indices in the file's order.

  Args:
    data: the file's bytes (`read_file`).
    path: the file, for the errors.
    num_clients: N.
    num_examples: M, the size of the training set; None checks everything
      but the upper bound (`check_range` checks it once M is known).

  Returns:
    The `num_clients` int64 index arrays.

  Raises:
    FileError: one line naming the file and what is wrong.
  """
  try:
    content = jsonfile.loads(data, path, top=None)
  except jsonfile.JsonFileError as e:
    raise FileError(path, e.reason) from None
  clients = _client_lists(content, num_clients, path)
  parts = [_client_indices(k, client, path) for k, client in enumerate(clients)]
  _check_disjoint(parts, path)
  if num_examples is not None:
    check_range(parts, num_examples, path)
  return parts


def check_range(
  parts: Sequence[np.ndarray], num_examples: int, path: str
) -> None:
  """Raises `FileError` naming `path` where a client of `parse_file`'s
  `parts` holds an index not below `num_examples`, the training set's
  size."""
  for k, p in enumerate(parts):
    high = int(p.max())
    if high >= num_examples:
      raise FileError(
        path,
        f'client {k} holds index {high}, out of range (the training set has '
        f'{num_examples} examples)',
      )


def _client_lists(content: object, num_clients: int, path: str) -> list:
  """The list of `num_clients` clients a partition file's JSON holds (the
  list itself, or its object's "clients")."""
  clients = content
  if isinstance(content, dict):
    if 'clients' not in content:
      raise FileError(
        path,
        'a JSON object without a "clients" key; expected a list of client '
        'index lists, or {"clients": [[...], ...]}',
      )
    clients = content['clients']
  if not isinstance(clients, list) or not clients:
    got = 'an empty list' if clients == [] else _json_type(clients)
    raise FileError(
      path,
      'expected a list of client index lists, or '
      f'{{"clients": [[...], ...]}}; got {got}',
    )
  if len(clients) != num_clients:
    raise FileError(
      path,
      f'{len(clients)} clients, but `num_clients={num_clients}`; pass '
      f'`num_clients={len(clients)}`',
    )
  return clients


def _client_indices(k: int, client: object, path: str) -> np.ndarray:
  """Client `k`'s entry of a partition file as int64 indices: a non-empty
  list of integers in `[0, 2**31)` (`check_range` checks the dataset's
  bound)."""
  if not isinstance(client, list):
    raise FileError(
      path, f'client {k} is {_json_type(client)}, not a list of example indices'
    )
  if not client:
    raise FileError(
      path, f'client {k} has no examples (each needs at least one)'
    )
  for value in client:
    if type(value) is not int:  # bool is an int subclass
      raise FileError(
        path,
        f'client {k} holds {json.dumps(value)[:40]}, not an integer example '
        'index',
      )
  low, high = min(client), max(client)
  if low < 0:
    raise FileError(path, f'client {k} holds index {low}; indices start at 0')
  if high > _MAX_INDEX:
    raise FileError(
      path,
      f'client {k} holds index {high}, out of range (indices are below 2**31)',
    )
  return np.array(client, np.int64)


def _check_disjoint(parts: list[np.ndarray], path: str) -> None:
  """Raises FileError naming the first index found in two clients, or
  twice in one."""
  everything = np.concatenate(parts)
  order = np.argsort(everything, kind='stable')
  repeated = np.flatnonzero(np.diff(everything[order]) == 0)
  if repeated.size:
    first, second = order[repeated[0]], order[repeated[0] + 1]
    owner = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
    a, b = int(owner[first]), int(owner[second])
    index = int(everything[first])
    found = f'twice in client {a}' if a == b else f'in clients {a} and {b}'
    raise FileError(
      path,
      f'index {index} is {found}; an example belongs to at most one client, '
      'once',
    )


def _json_type(value: object) -> str:
  """The JSON name of a parsed value's type, with an article."""
  if isinstance(value, bool) or value is None:
    return json.dumps(value)
  if isinstance(value, dict):
    return 'an object'
  if isinstance(value, list):
    return 'a list'
  if isinstance(value, str):
    return 'a string'
  return 'a number'


def _check_counts(num_examples: int, num_clients: int, min_size: int) -> None:
  errors.check_count('num_clients', num_clients)
  if num_clients * min_size > num_examples:
    raise errors.ArgumentError(
      'num_clients',
      f'with at least {min_size} examples each needs '
      f'{num_clients * min_size} examples; the dataset has {num_examples}',
    )


def summary(
  parts: Sequence[np.ndarray], labels: np.ndarray, num_classes: int
) -> dict:
  """Client sizes and per-client label histograms (JSON-serialisable);
  'unassigned' counts the training examples in no client."""
  labels = np.asarray(labels)
  sizes = [int(len(p)) for p in parts]
  hist = [
    np.bincount(labels[p], minlength=num_classes).astype(int).tolist()
    for p in parts
  ]
  classes_per_client = [int(np.count_nonzero(h)) for h in hist]
  return {
    'num_clients': len(parts),
    'sizes': sizes,
    'unassigned': len(labels) - sum(sizes),
    'size_min': min(sizes),
    'size_max': max(sizes),
    'size_mean': float(np.mean(sizes)),
    'classes_per_client_mean': float(np.mean(classes_per_client)),
    'label_histograms': hist,
  }


def save_summary(path: str, summary_dict: dict) -> None:
  """Writes the summary as JSON, atomically (temporary file, rename)."""
  files.write_atomic(path, lambda f: json.dump(summary_dict, f))
