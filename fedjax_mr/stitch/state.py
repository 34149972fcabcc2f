"""The state of a FedStitch run, and its files.

`State` is everything a run needs to resume after `round` rounds: the
clients' weights, the candidate networks (`Live`, with the votes and CKA
sums of the selection in progress), the finished networks and the log.
`save_state` / `load_state` keep it in one .npz that is never a pickle
(`write_document` / `read_document`, also used for the stitched networks).
"""

from __future__ import annotations

import io
import json
from typing import Any
from typing import NamedTuple
from typing import Sequence

import jax
import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.core import files
from fedjax_mr.stitch import network as network_lib
from fedjax_mr.stitch import pool as pool_lib
from fedjax_mr.stitch import projection


class Live(NamedTuple):
  """A candidate network and what the selection in progress gathered."""

  net: network_lib.Network
  remaining: frozenset[int]
  votes: np.ndarray  # [pool size] accumulated this selection
  score_sum: np.ndarray  # [pool size] weighted CKA sums
  score_weight: np.ndarray  # [pool size] their weights
  share: float  # product of the vote shares along the path
  path_score: float  # product of the chosen blocks' mean CKA (StitchNet)


class Finished(NamedTuple):
  """A finished stitched network and how it was found."""

  net: network_lib.Network
  round: int
  share: float
  path_score: float


class State(NamedTuple):
  """Everything a run needs to resume after `round` rounds."""

  round: int
  weights: np.ndarray
  live: tuple[Live, ...]
  finished: tuple[Finished, ...]
  fit_ids: tuple[int, ...]
  log: tuple[dict, ...]


def init_state(
  pool: pool_lib.Pool, num_clients: int, starts: Sequence[int] | None = None
) -> State:
  """Round 0: uniform weights, one candidate network per start block."""
  n = len(pool.blocks)
  start_ids = pool.starts() if starts is None else list(starts)
  live = tuple(
    Live(
      network_lib.start(pool.blocks[i]),
      frozenset(range(n)),
      np.zeros(n),
      np.zeros(n),
      np.zeros(n),
      1.0,
      1.0,
    )
    for i in start_ids
  )
  return State(0, np.full(num_clients, 1.0 / num_clients), live, (), (), ())


def to_host(state: State) -> dict:
  """The state as plain Python and numpy (what `save_state` stores)."""

  def stitches(net):
    return [
      None
      if s is None
      else {
        'matrix': None if s.matrix is None else np.asarray(s.matrix),
        'bias': None if s.bias is None else np.asarray(s.bias),
        'pool': s.pool,
        'size': s.size,
      }
      for s in net.stitches
    ]

  return {
    'round': state.round,
    'weights': state.weights,
    'live': [
      {
        'path': list(lv.net.path),
        'stitches': stitches(lv.net),
        'remaining': sorted(lv.remaining),
        'votes': lv.votes,
        'score_sum': lv.score_sum,
        'score_weight': lv.score_weight,
        'share': lv.share,
        'path_score': lv.path_score,
      }
      for lv in state.live
    ],
    'finished': [
      {
        'path': list(f.net.path),
        'stitches': stitches(f.net),
        'round': f.round,
        'share': f.share,
        'path_score': f.path_score,
      }
      for f in state.finished
    ],
    'fit_ids': list(state.fit_ids),
    'log': list(state.log),
  }


def _net_from_host(pool: pool_lib.Pool, path, stitches) -> network_lib.Network:
  by_id = {b.id: b for b in pool.blocks}
  blocks = tuple(by_id[tuple(p)] for p in path)
  sts = tuple(
    None
    if s is None
    else projection.Stitch(
      None if s['matrix'] is None else jax.numpy.asarray(s['matrix']),
      None if s['bias'] is None else jax.numpy.asarray(s['bias']),
      s['pool'],
      None if s['size'] is None else tuple(s['size']),
    )
    for s in stitches
  )
  return network_lib.Network(blocks, sts)


def _from_host(pool: pool_lib.Pool, d: dict) -> State:
  live = tuple(
    Live(
      _net_from_host(pool, lv['path'], lv['stitches']),
      frozenset(lv['remaining']),
      lv['votes'],
      lv['score_sum'],
      lv['score_weight'],
      lv['share'],
      lv['path_score'],
    )
    for lv in d['live']
  )
  finished = tuple(
    Finished(
      _net_from_host(pool, f['path'], f['stitches']),
      f['round'],
      f['share'],
      f['path_score'],
    )
    for f in d['finished']
  )
  return State(
    d['round'],
    d['weights'],
    live,
    finished,
    tuple(d['fit_ids']),
    tuple(d['log']),
  )


# The state file: one .npz whose entry `STATE_ENTRY` is a JSON document
# (format name and version, the run's identity, the state with each array
# replaced by a reference) and whose other entries are the arrays. Nothing
# is ever unpickled: numpy reads it with allow_pickle=False.
STATE_FORMAT = 'fedjax_mr.fedstitch.state'
STATE_VERSION = 1
STATE_ENTRY = '__document__'


class StateFileError(errors.UserError):
  """A state file that cannot be read, or that holds another run."""


def _encode(value: Any, arrays: dict[str, np.ndarray]) -> Any:
  """JSON-able form of plain Python / numpy data; arrays go to `arrays`."""
  if isinstance(value, (np.ndarray, jax.Array)):
    name = f'a{len(arrays)}'
    arrays[name] = np.asarray(value)
    return {'__array__': name}
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, dict):
    if not all(isinstance(k, str) for k in value):
      raise TypeError(f'state dict keys must be strings: {list(value)[:3]}')
    return {k: _encode(v, arrays) for k, v in value.items()}
  if isinstance(value, tuple):
    return {'__tuple__': [_encode(v, arrays) for v in value]}
  if isinstance(value, list):
    return [_encode(v, arrays) for v in value]
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  raise TypeError(f'cannot store {type(value).__name__} in a state file')


def _decode(value: Any, arrays: Any) -> Any:
  if isinstance(value, dict):
    if set(value) == {'__array__'}:
      return np.asarray(arrays[value['__array__']])
    if set(value) == {'__tuple__'}:
      return tuple(_decode(v, arrays) for v in value['__tuple__'])
    return {k: _decode(v, arrays) for k, v in value.items()}
  if isinstance(value, list):
    return [_decode(v, arrays) for v in value]
  return value


def document(payload: Any, identity: Any = None) -> bytes:
  """`payload` (plain Python, numpy arrays, tuples) and the run's
  `identity` (JSON-able) as the bytes of a versioned .npz."""
  arrays: dict[str, np.ndarray] = {}
  doc = {
    'format': STATE_FORMAT,
    'version': STATE_VERSION,
    'identity': identity,
    'payload': _encode(payload, arrays),
  }
  text = json.dumps(doc).encode('utf-8')
  arrays[STATE_ENTRY] = np.frombuffer(text, np.uint8)
  out = io.BytesIO()
  np.savez(out, **arrays)
  return out.getvalue()


def write_document(path: str, payload: Any, identity: Any = None) -> None:
  """Writes `document(payload, identity)` to `path`, atomically (a
  temporary file, then a rename)."""
  data = document(payload, identity)
  files.write_atomic(path, lambda f: f.write(data), binary=True)


def read_document(path: str) -> tuple[Any, Any]:
  """`(payload, identity)` of a file `write_document` wrote.

  Raises:
    StateFileError: not such a file (damaged, another format or version);
      the message names the file.
  """
  try:
    with open(path, 'rb') as f:
      data = f.read()
  except OSError as e:
    raise StateFileError(f'{path} does not read: {e.strerror or e}') from None
  return parse_document(data, path)


def parse_document(data: bytes, where: str) -> tuple[Any, Any]:
  """`(payload, identity)` of `document`'s bytes `data` (read from
  `where`, which messages name).

  Raises:
    StateFileError: not such a document (damaged, another format or
      version).
  """
  try:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
      arrays = {k: npz[k] for k in npz.files}
    if STATE_ENTRY not in arrays:
      raise StateFileError(f'{where} is not a FedStitch state file')
    doc = json.loads(arrays.pop(STATE_ENTRY).tobytes().decode('utf-8'))
  except StateFileError:
    raise
  except Exception as e:  # noqa: BLE001 (zip, numpy, JSON, unicode, ...)
    raise StateFileError(
      f'{where} is not a readable FedStitch state file '
      f'({type(e).__name__}: {" ".join(str(e).split())[:120]})'
    ) from None
  if not isinstance(doc, dict) or doc.get('format') != STATE_FORMAT:
    raise StateFileError(f'{where} is not a FedStitch state file')
  if doc.get('version') != STATE_VERSION:
    raise StateFileError(
      f'{where} has state format version {doc.get("version")!r}; this '
      f'version of fedjax_mr reads version {STATE_VERSION}'
    )
  try:
    return _decode(doc['payload'], arrays), doc.get('identity')
  except KeyError as e:
    raise StateFileError(f'{where} refers to a missing array {e}') from None


def save_state(path: str, state: State, identity: Any = None) -> None:
  """Writes the state and the run's identity (JSON-able, e.g. its flags)
  to `path` (see `write_document`)."""
  write_document(path, to_host(state), identity)


def load_state(path: str, pool: pool_lib.Pool, identity: Any = None) -> State:
  """The state `save_state` wrote.

  Raises:
    StateFileError: an unreadable file, or (with `identity`) a state saved
      by a run of another identity (the differing keys are named).
  """
  return state_of(read_document(path), pool, identity, path)


def state_of(
  read: tuple[Any, Any], pool: pool_lib.Pool, identity: Any, where: str
) -> State:
  """The state of a document's `(payload, identity)` (`parse_document`;
  read from `where`), refused if saved by a run of another `identity`
  (None: not checked).

  Raises:
    StateFileError: another run's, or a state that does not fit `pool`.
  """
  payload, saved = read
  if identity is not None and saved != identity:
    if isinstance(saved, dict) and isinstance(identity, dict):
      keys = sorted(set(saved) | set(identity))
      diffs = [
        f'`{k}={saved.get(k)!r}` there, {identity.get(k)!r} here'
        for k in keys
        if saved.get(k) != identity.get(k)
      ]
    else:
      diffs = ['another run']
    raise StateFileError(
      f'{where} holds a run of a different config ({"; ".join(diffs)}); '
      'pass another `workdir` or the same flags'
    )
  try:
    return _from_host(pool, payload)
  except (KeyError, TypeError, ValueError) as e:
    raise StateFileError(
      f'{where} does not fit this pool ({type(e).__name__}: {e})'
    ) from None


# A checkpoint of a run's state (`fedjax_mr.runtime.checkpoint`): the
# bytes of its document (`document`) as one array, so that a state of any
# shape (networks added, dropped, finished) saves and restores whole.
CHECKPOINT_ENTRY = 'document'


def to_checkpoint(state: State, identity: Any = None) -> dict[str, np.ndarray]:
  """The tree a checkpoint of `state` holds: `{CHECKPOINT_ENTRY: bytes}`
  of its document with the run's `identity`."""
  data = document(to_host(state), identity)
  return {CHECKPOINT_ENTRY: np.frombuffer(data, np.uint8)}


def from_checkpoint(
  tree: Any, pool: pool_lib.Pool, identity: Any, where: str
) -> State:
  """The state of a checkpoint's tree (`to_checkpoint`; read from
  `where`), refused if saved by a run of another `identity`.

  Raises:
    StateFileError: not such a tree, another run's, or a state that does
      not fit `pool`.
  """
  entry = tree.get(CHECKPOINT_ENTRY) if isinstance(tree, dict) else None
  if entry is None:
    raise StateFileError(f'{where} holds no FedStitch state')
  data = np.ascontiguousarray(entry, np.uint8).tobytes()
  return state_of(parse_document(data, where), pool, identity, where)


def rows_of(entry: dict) -> tuple[dict, dict]:
  """A round's log entry as the run's two record rows: the metrics row
  (the entry, its energy record left out, numbered as the state after it:
  `round` + 1) and the clients row (each participant's id and time; the
  energy record of the round, if any)."""
  r = entry['round'] + 1
  row = {'round': r}
  row.update((k, v) for k, v in entry.items() if k not in ('round', 'energy'))
  clients = [
    {'id': c, 'time_s': t}
    for c, t in zip(entry['clients'], entry['client_time_s'])
  ]
  clients_row = {'round': r, 'clients': clients}
  if 'energy' in entry:
    clients_row['energy'] = entry['energy']
  return row, clients_row
