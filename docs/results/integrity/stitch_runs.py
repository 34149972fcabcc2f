"""Two FedStitch workdirs compared bit for bit, times aside
(stitch_one_loop.sh): results.json, log.jsonl, energy.jsonl, the arrays
and JSON documents of networks.npz and of the final state (state.npz of a
workdir from before the one loop, else the newest checkpoint's document),
and with `records` metrics.jsonl and clients.jsonl."""

import hashlib
import io
import json
import os

import numpy as np

from fedjax_mr.runtime import checkpoint
from fedjax_mr.stitch import state as state_lib

_TIMES = ('run_seconds', 'selection_seconds_total', 'peak_host_mib')


def _timeless(value):
  if isinstance(value, dict):
    return {
      k: _timeless(v)
      for k, v in value.items()
      if not (
        k.endswith(('_time_s', '_seconds', 'seconds_per_round', 'time_s'))
        or k in _TIMES
      )
    }
  if isinstance(value, list):
    return [_timeless(v) for v in value]
  return value


def _state_bytes(workdir):
  old = os.path.join(workdir, 'state.npz')
  if not os.path.isdir(os.path.join(workdir, checkpoint.FOLDER)):
    with open(old, 'rb') as f:
      return 'state.npz', f.read()
  ckpt = checkpoint.Checkpointer(workdir)
  try:
    found = ckpt.find(None)
  finally:
    ckpt.close()
  entry = found.state[state_lib.CHECKPOINT_ENTRY]
  return f'checkpoints/{found.round}', entry.tobytes()


def _npz(data):
  arrays, document = {}, None
  with np.load(io.BytesIO(data), allow_pickle=False) as z:
    for key in sorted(z.files):
      a = np.ascontiguousarray(z[key])
      if key == state_lib.STATE_ENTRY:
        document = _timeless(json.loads(a.tobytes()))
      else:
        arrays[key] = hashlib.sha256(
          f'{a.shape}{a.dtype}'.encode() + a.tobytes()
        ).hexdigest()
  return arrays, document


def _read(workdir, records):
  def lines(name):
    with open(os.path.join(workdir, name)) as f:
      return [_timeless(json.loads(x)) for x in f]

  with open(os.path.join(workdir, 'results.json')) as f:
    got = {'results.json': _timeless(json.load(f))}
  for name in ('log.jsonl', 'energy.jsonl'):
    got[name] = lines(name)
  if records:
    for name in ('metrics.jsonl', 'clients.jsonl'):
      got[name] = lines(name)
  with open(os.path.join(workdir, 'networks.npz'), 'rb') as f:
    got['networks.npz'] = _npz(f.read())
  where, data = _state_bytes(workdir)
  got['state'] = _npz(data)
  return got, where


def compare(a, b, records=False):
  (ga, wa), (gb, wb) = _read(a, records), _read(b, records)
  print(f'  final state: {wa} against {wb}')
  for name in ga:
    same = ga[name] == gb[name]
    size = ''
    if name in ('networks.npz', 'state'):
      size = f' ({len(ga[name][0])} arrays)'
    elif isinstance(ga[name], list):
      size = f' ({len(ga[name])} rows)'
    print(f'  {name}{size}: {"equal" if same else "DIFFER"}')


if __name__ == '__main__':
  import sys

  compare(sys.argv[1], sys.argv[2], records='records' in sys.argv[3:])
