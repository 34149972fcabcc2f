"""The node side of a secure round (SecAgg+, `fedjax_mr.privacy.secagg`):
each of the node's clients through the protocol's four stages.

A secure round's request for client c holds a `secagg` record: its stage
(`keys`, `share`, `mask`, `unmask`), the client, the round and the
attempt (16 random bytes the server draws for each try of a round). The
client's secrets of the attempt (its seed, its neighbours' public keys,
the shares it received) are kept between the stages in the run's state
folder (`node.run_folder`), as `secagg/client<c>.json`, readable by the
node's user alone (0600, in a 0700 folder): Flower runs each message in
a new process.
Stage `keys` starts an attempt (a new seed, whatever was there); each
other stage must follow the one before it in the same attempt and round,
once: a replayed, reordered or duplicated stage is refused, and so is a
second unmasking, since the file is removed once the client has revealed
its shares.

- `keys`: replies the client's two public keys, signed by the node's
  key where it has one (`sign`).
- `share`: `peers` names each neighbour and its keys, `signatures` their
  nodes' signatures (a node with the federation's roster, `identity`,
  refuses keys its peer's node did not sign, so a server cannot slip its
  own keys in); at least t - 1 neighbours of the configured degree
  (`min_peers`); replies the encrypted shares for each (its own kept).
- `mask`: carries the training request (`node.client_output` runs it,
  with the secure wrapper's encoded upload as `extra`) and `shares`, the
  ciphertexts addressed to the client, from neighbours it was told of;
  each must open; replies the upload masked with the self mask and the
  pairwise masks of those senders (`secagg.mask_input`) and the client's
  example and step counts (which the server knows already).
- `unmask`: names the survivors and the dropped among those senders
  (disjoint; the survivors at least t - 1 besides the client); replies a
  share of each and of its own self mask, which it kept
  (`secagg.reveal`).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import ConfigRecord
from flwr.app import RecordDict

from fedjax_mr.core import files
from fedjax_mr.deploy import codec
from fedjax_mr.deploy import node as node_lib
from fedjax_mr.pipeline import protection
from fedjax_mr.privacy import distributed_dp
from fedjax_mr.privacy import secagg

SECAGG = node_lib.SECURE_STAGE  # the record that names a request's stage
ERROR = 'error'  # the record of a refused stage's reply
STAGES = ('keys', 'share', 'mask', 'unmask')
ATTEMPT_BYTES = 16


class Run(NamedTuple):
  """A secure run as a node's stages need it: its `config` and `setup()`,
  which builds its experiment (`adapter.setup`: the data, the model, the
  algorithm). Only stage `mask` trains, so only it calls `setup`: Flower
  runs each message in a new process, and the three other stages would
  otherwise set the run up for nothing."""

  config: Any
  setup: Callable[[], Any]

  @classmethod
  def of(cls, experiment: Any) -> Run:
    """The run of an experiment already set up."""
    return cls(experiment.config, lambda: experiment)


def context(round_index: int, attempt: bytes) -> bytes:
  """What binds an attempt's keys, masks and shares: the round and the
  attempt's random bytes."""
  return b'fedjax_mr secagg v1|%d|' % int(round_index) + bytes(attempt)


def degree(config: Any, k: int) -> int:
  """A client's number of neighbours in a round of `k` clients as
  configured: `secagg_neighbours`, or every other client."""
  d = int(config.privacy.secure.neighbours)
  return k - 1 if d == 0 or d >= k - 1 else d


def min_peers(config: Any) -> int:
  """The fewest neighbours a client shares with: t - 1 of the configured
  degree (with its own share, t; fewer could not rebuild its secrets in
  any case)."""
  s = config.privacy.secure
  k = config.server.clients_per_round
  return secagg.threshold(degree(config, k), s.threshold) - 1


class Identity(NamedTuple):
  """A node's keys for the protocol's public keys: its own signing key
  (its Flower authentication key) and the federation's roster (every
  node's public key by index). Either may be None (a node started
  without them, an insecure federation): then it does not sign, or does
  not check its peers' signatures."""

  key: Any = None
  roster: dict[int, Any] | None = None


NO_IDENTITY = Identity()


def identity(node_config: Any) -> Identity:
  """The `Identity` a node config names: `signing-key` (a private key
  file, OpenSSH or PEM) and `roster` (a JSON file `{index: OpenSSH public
  key}`), each optional."""
  key = roster = None
  if node_config.get('signing-key'):
    with open(str(node_config['signing-key']), 'rb') as f:
      data = f.read()
    load = (
      serialization.load_ssh_private_key
      if data.startswith(b'-----BEGIN OPENSSH')
      else serialization.load_pem_private_key
    )
    key = load(data, password=None)
  if node_config.get('roster'):
    with open(str(node_config['roster'])) as f:
      listed = json.load(f)
    roster = {
      int(i): serialization.load_ssh_public_key(k.encode())
      for i, k in listed.items()
    }
  return Identity(key, roster)


def _signed(ctx: bytes, client: int, keys: bytes) -> bytes:
  return b'fedjax_mr secagg keys|' + ctx + b'|%d|' % int(client) + keys


def sign(who: Identity, ctx: bytes, client: int, keys: bytes) -> bytes:
  """The node's ECDSA (SHA-384) signature of `client`'s public keys of
  the attempt `ctx` (empty without a key)."""
  if who.key is None:
    return b''
  return who.key.sign(_signed(ctx, client, keys), ec.ECDSA(hashes.SHA384()))


def check_signature(
  who: Identity,
  num_nodes: int,
  ctx: bytes,
  client: int,
  keys: bytes,
  sig: bytes,
) -> None:
  """Refuses `client`'s keys unless the node that serves it signed them
  (where `who` holds a roster).

  Raises:
    RequestError: no signature, or not its node's.
  """
  if who.roster is None:
    return
  public = who.roster.get(int(client) % num_nodes)
  try:
    if public is None:
      raise InvalidSignature
    public.verify(sig, _signed(ctx, client, keys), ec.ECDSA(hashes.SHA384()))
  except (InvalidSignature, ValueError):
    raise node_lib.RequestError(
      f'the keys of client {client} are not signed by its node'
    ) from None


def _path(folder: str, client: int) -> str:
  return os.path.join(folder, 'secagg', f'client{int(client)}.json')


NOISE_SECRET = 'noise.key'  # the node's secret of its DP noise (secagg/)


def noise_secret(folder: str) -> bytes:
  """The node's 32 random bytes in `<folder>/secagg/noise.key` (0600 in a
  0700 folder), made on first use: with a client's key, the seed of its
  distributed DP noise (`distributed_dp.node_secret`), which the server
  (which made the key) cannot draw again. Kept for the run: a round the
  server runs again draws the same noise, not a fresh draw to average.

  Raises:
    RequestError: a secret file that is not 32 bytes or is open to others.
  """
  here = os.path.join(folder, 'secagg')
  os.makedirs(here, mode=0o700, exist_ok=True)
  os.chmod(here, 0o700)
  path = os.path.join(here, NOISE_SECRET)
  try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  except FileExistsError:
    pass
  else:
    with os.fdopen(fd, 'wb') as f:
      f.write(os.urandom(32))
  if os.stat(path).st_mode & 0o077:
    raise node_lib.RequestError(f'{path} is open to others: chmod 600 it')
  with open(path, 'rb') as f:
    secret = f.read()
  if len(secret) != 32:
    raise node_lib.RequestError(f'{path} does not hold 32 bytes')
  return secret


def _save(folder: str, client: int, kept: dict) -> None:
  os.makedirs(os.path.join(folder, 'secagg'), mode=0o700, exist_ok=True)
  for f in (folder, os.path.join(folder, 'secagg')):
    os.chmod(f, 0o700)
  text = json.dumps(kept)
  files.write_atomic(_path(folder, client), lambda f: f.write(text), mode=0o600)


def _load(folder: str, client: int, stage: str, meta: dict) -> dict:
  """The client's kept attempt, which must be at the stage before
  `stage`, of the same round and attempt."""
  path = _path(folder, client)
  try:
    with open(path) as f:
      kept = json.load(f)
  except FileNotFoundError:
    raise node_lib.RequestError(
      f'client {client}: stage {stage} of no attempt it is in'
    ) from None
  before = STAGES[STAGES.index(stage) - 1]
  if (
    kept.get('stage') != before
    or kept.get('round') != meta['round']
    or kept.get('attempt') != meta['attempt'].hex()
  ):
    raise node_lib.RequestError(
      f'client {client}: stage {stage} out of turn (it is at '
      f'{kept.get("stage")} of round {kept.get("round", -1) + 1})'
    )
  return kept


def _meta(part: RecordDict, num_clients: int) -> dict:
  record = part[SECAGG]
  meta = {
    'stage': str(record['stage']),
    'client': int(record['client']),
    'round': int(record['round']),
    'attempt': bytes(record['attempt']),
  }
  if meta['stage'] not in STAGES or len(meta['attempt']) != ATTEMPT_BYTES:
    raise node_lib.RequestError(f'a malformed {SECAGG} record')
  if not 0 <= meta['client'] < num_clients:
    raise node_lib.RequestError(f'client {meta["client"]} does not exist')
  return meta


def _ids(record: Any, num_clients: int, what: str) -> dict[int, bytes]:
  out = {}
  for key, value in record.items():
    if not key.isdigit() or int(key) >= num_clients:
      raise node_lib.RequestError(f'{what} names no client: {key!r}')
    out[int(key)] = bytes(value)
  return out


def serve(
  run: Run,
  content: RecordDict,
  node: int,
  num_nodes: int,
  state_folder: str | None,
  who: Identity = NO_IDENTITY,
) -> RecordDict:
  """Serves a packed message of a secure run (`node.pack`): each client's
  stage with `serve_part` (signing and checking keys as `who` allows),
  replied under its position (the run set up once, by the first client's
  `mask`, if any); a stage refused is replied as an `error` record saying
  why (the server counts the client as failed and logs it). A request
  without a stage (a plain training request, whose reply would be the
  client's model in the clear) refuses the whole message.

  Raises:
    RequestError: a plain request, or a malformed message.
  """
  replies = {}
  run = run._replace(setup=functools.cache(run.setup))
  for position, part in sorted(node_lib.unpack(content).items()):
    if SECAGG not in part:
      raise node_lib.RequestError(
        'a plain training request in a secure run: this node replies '
        'masked inputs only'
      )
    try:
      replies[position] = serve_part(
        run, part, node, num_nodes, state_folder, who
      )
    except (node_lib.RequestError, KeyError, TypeError, ValueError) as e:
      reason = str(e) or type(e).__name__
      replies[position] = RecordDict(
        {ERROR: ConfigRecord({'reason': reason[:500]})}
      )
  return node_lib.pack(replies)


def serve_part(
  run: Run,
  part: RecordDict,
  node: int,
  num_nodes: int,
  state_folder: str | None,
  who: Identity = NO_IDENTITY,
) -> RecordDict:
  """One client's stage of a secure round (module docstring); `who`
  signs the client's keys and checks its peers'.

  Raises:
    RequestError: what the stage refuses (its message says why).
  """
  n = run.config.partition.num_clients
  meta = _meta(part, n)
  client = meta['client']
  if client % num_nodes != node:
    raise node_lib.RequestError(f'client {client} is not served by node {node}')
  if not state_folder:
    raise node_lib.RequestError('a node of a secure run needs a state folder')
  ctx = context(meta['round'], meta['attempt'])
  stage = meta['stage']
  if stage == 'keys':
    seed = secagg.new_seed()
    c_pk, s_pk = secagg.public_keys(seed)
    kept = {'stage': 'keys', 'seed': seed.hex()}
    kept.update(round=meta['round'], attempt=meta['attempt'].hex())
    _save(state_folder, client, kept)
    sig = sign(who, ctx, client, c_pk + s_pk)
    return RecordDict(
      {'keys': ConfigRecord({'c': c_pk, 's': s_pk, 'sig': sig})}
    )
  kept = _load(state_folder, client, stage, meta)
  seed = bytes.fromhex(kept['seed'])
  try:
    if stage == 'share':
      _check_peers(part, who, num_nodes, ctx, n)
      reply = _share(run.config, part, kept, seed, client, ctx, n)
    elif stage == 'mask':
      where = (node, num_nodes, state_folder)
      reply = _mask(run.setup(), part, kept, seed, where, ctx)
    else:
      reply = _unmask(run.config, part, kept, seed, client, ctx)
  except secagg.ProtocolError as e:
    raise node_lib.RequestError(str(e)) from None
  if stage == 'unmask':
    os.remove(_path(state_folder, client))
  else:
    kept['stage'] = stage
    _save(state_folder, client, kept)
  return reply


def _check_peers(part, who, num_nodes, ctx, n) -> None:
  """Each peer's keys signed by the node that serves it (`check_signature`;
  `signatures` holds them, by client)."""
  if who.roster is None:
    return
  peers = _ids(part['peers'], n, 'peers')
  sigs = (
    _ids(part['signatures'], n, 'signatures') if 'signatures' in part else {}
  )
  for v, keys in peers.items():
    check_signature(who, num_nodes, ctx, v, keys, sigs.get(v, b''))


def _share(config, part, kept, seed, client, ctx, n) -> RecordDict:
  peers = _ids(part['peers'], n, 'peers')
  if client in peers or any(len(v) != 64 for v in peers.values()):
    raise node_lib.RequestError(f'client {client}: malformed peers')
  if len(peers) < min_peers(config):
    raise node_lib.RequestError(
      f'client {client}: {len(peers)} neighbours, fewer than the '
      f'{min_peers(config)} that rebuild its secrets'
    )
  t = secagg.threshold(len(peers), config.privacy.secure.threshold)
  keys = {v: (pk[:32], pk[32:]) for v, pk in peers.items()}
  out = secagg.share_keys(seed, client, keys, t, ctx)
  kept['peers'] = {str(v): pk.hex() for v, pk in peers.items()}
  kept['own'] = out.pop(client).hex()
  return RecordDict(
    {'shares': ConfigRecord({str(v): c for v, c in out.items()})}
  )


def _mask(experiment, part, kept, seed, where, ctx) -> RecordDict:
  client = int(part[SECAGG]['client'])
  train = part['meta']
  if (int(train['client']), int(train['round'])) != (client, kept['round']):
    raise node_lib.RequestError(
      f'client {client}: the training request is of another client or round'
    )
  peers = {int(v): bytes.fromhex(pk) for v, pk in kept['peers'].items()}
  got = _ids(part['shares'], len(experiment.client_sizes), 'shares')
  if not set(got) <= set(peers):
    raise node_lib.RequestError(
      f'client {client}: shares from {sorted(set(got) - set(peers))}, '
      'not its neighbours'
    )
  for v, ciphertext in got.items():  # each must open before any mask
    secagg.open_share(seed, client, v, peers[v][:32], ciphertext, ctx)
  if protection.distributed(experiment.config.privacy):
    secret = noise_secret(where[2])
    with distributed_dp.node_secret(lambda c: secret):
      output = node_lib.client_output(experiment, part, *where)
  else:
    output = node_lib.client_output(experiment, part, *where)
  values = np.concatenate(
    [np.asarray(x, np.uint32).ravel() for x in jax.tree.leaves(output.extra)]
  )
  sharers = {v: peers[v][32:] for v in got}
  bits = experiment.config.privacy.secure.bits
  masked = secagg.mask_input(seed, client, sharers, values, bits, ctx)
  kept['shares'] = {str(v): c.hex() for v, c in got.items()}
  counts = {
    'num_examples': int(output.num_examples),
    'num_steps': int(output.num_steps),
  }
  return RecordDict(
    {
      'masked': codec.encode({'y': masked}),
      'counts': ConfigRecord(counts),
    }
  )


def _unmask(config, part, kept, seed, client, ctx) -> RecordDict:
  survivors = [int(v) for v in part[SECAGG]['survivors']]
  dropped = [int(v) for v in part[SECAGG]['dropped']]
  peers = {int(v): bytes.fromhex(pk) for v, pk in kept['peers'].items()}
  shares = {int(v): bytes.fromhex(c) for v, c in kept['shares'].items()}
  t = secagg.threshold(len(peers), config.privacy.secure.threshold)
  if len(set(survivors) - {client}) + 1 < t:
    raise node_lib.RequestError(
      f'client {client}: {len(set(survivors))} surviving neighbours, the '
      f'sum would cover fewer than t = {t} clients'
    )
  senders = {v: (peers[v][:32], shares[v]) for v in shares}
  own_c_pk = secagg.public_keys(seed)[0]
  senders[client] = (own_c_pk, bytes.fromhex(kept['own']))
  out = secagg.reveal(seed, client, senders, survivors, dropped, ctx)
  return RecordDict(
    {'revealed': ConfigRecord({str(v): s for v, s in out.items()})}
  )
