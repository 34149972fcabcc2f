"""The server side of a secure round: the round's sum through SecAgg+
(`fedjax_mr.privacy.secagg`), never a client's upload in the clear.

`make_collect(experiment, transport, timeout, log)` gives
`server.make_round` its `collect(requests, round, template, weights)`:
one attempt of the protocol (16 random bytes name it, `secure_node.
context`) over the transport, four exchanges with the round's clients
(`secure_node` serves them):

0. `keys`: every client; those whose two 32-byte keys arrive advertised.
1. `share`: each advertised client gets its neighbours' keys and their
   nodes' signatures of them, which the nodes check (`secagg.neighbours`
   over the advertised clients, the attempt's bytes as the graph's
   seed); those whose ciphertexts, one for each neighbour, arrive
   shared.
2. `mask`: each sharing client gets its training request and the
   ciphertexts addressed to it by sharing neighbours; its masked upload
   (one uint32 vector of the upload's size) is added to the running sum
   as it arrives (the server holds one vector, never K), and its example
   and step counts are checked (`server.check_weights`: the server knows
   them anyway). Those clients survive.
3. `unmask`: each survivor is told which of its sharing neighbours
   survived and which dropped, and reveals a share of each;
   `secagg.unmask` strips the masks.

A client that fails a stage (no reply in `timeout`, a reply refused, or
its node's refusal, each logged in one line) is out of the later stages;
one that fails the last still counts, since its masked upload is in the
sum: the sum is that of exactly the survivors. Where fewer than t
clients (t of the configured degree) advertise or share, fewer than t
survive, or a secret lacks t shares, the round fails
(`SecureRoundError`, one line: the run stops, its checkpoints kept, and
resumes from the last one when started again). The clients' losses stay
NaN: the secure wrapper's upload holds them, summed.
"""

from __future__ import annotations

import secrets
from typing import Any
from typing import Callable
from typing import Sequence

import jax
import numpy as np
from flwr.app import ConfigRecord
from flwr.app import RecordDict

from fedjax_mr.core import types
from fedjax_mr.deploy import codec
from fedjax_mr.deploy import secure_node
from fedjax_mr.deploy import server
from fedjax_mr.pipeline import protection
from fedjax_mr.privacy import distributed_dp
from fedjax_mr.privacy import secagg

# An ECDSA P-384 signature (DER) takes at most 104 bytes.
MAX_SIGNATURE_BYTES = 256


class SecureRoundError(server.NoClientError):
  """A secure round that cannot finish (too few clients, or too few
  shares); its message says which."""


def _request(req, stage, r, attempt, records=None, training=False):
  meta = ConfigRecord(
    {'stage': stage, 'client': req.client, 'round': r, 'attempt': attempt}
  )
  content = RecordDict({secure_node.SECAGG: meta})
  for name, record in (records or {}).items():
    if name in ('survivors', 'dropped'):
      meta[name] = record
    else:
      content[name] = record
  if training:
    for name, record in req.content.items():
      content[name] = record
  return server.Request(req.position, req.client, req.node, content)


def _gather(transport, requests, read, timeout, log, r, stage):
  """`(position, read(reply))` of the stage's replies that `read` accepts
  (it raises `codec.ReplyError` otherwise), as they arrive; each failure
  logged."""
  clients = {q.position: q.client for q in requests}
  for position, reply in transport.exchange(requests, timeout):
    who = f'round {r + 1}: client {clients[position]}'
    if reply is None:
      log(f'{who} failed at secure stage {stage} (no reply)')
      continue
    if secure_node.ERROR in reply:
      reason = str(reply[secure_node.ERROR].get('reason', ''))
      log(f'{who} refused by its node at secure stage {stage}: {reason}')
      continue
    try:
      value = read(reply, clients[position])
    except (codec.ReplyError, KeyError, TypeError, ValueError) as e:
      log(f'{who} refused at secure stage {stage}: {e}')
      continue
    yield position, value


def _read_keys(reply, client) -> tuple[bytes, bytes, bytes]:
  """`(c_pk, s_pk, its node's signature)`."""
  keys = reply['keys']
  c, s, sig = bytes(keys['c']), bytes(keys['s']), bytes(keys.get('sig', b''))
  if len(c) != secagg.KEY_BYTES or len(s) != secagg.KEY_BYTES:
    raise codec.ReplyError('its public keys are not 32 bytes each')
  if len(sig) > MAX_SIGNATURE_BYTES:
    raise codec.ReplyError('its signature is too long')
  return c, s, sig


def make_collect(
  experiment: Any,
  transport: server.Transport,
  timeout: float | None = None,
  log: Callable[[str], None] = print,
) -> Callable:
  """`collect(requests, round, template, weights) -> (Sums, failed)`, a
  secure round's sum (module docstring)."""

  def collect(requests, r, template, weights):
    attempt = _Attempt(experiment.config, transport, timeout, log)
    return attempt.run(requests, r, template, weights)

  return collect


class _Attempt:
  """One attempt of a secure round: its stages in order (`run`)."""

  def __init__(self, config, transport, timeout, log):
    self.secure = config.privacy.secure
    self.degree = secure_node.degree(config, config.server.clients_per_round)
    self.need = secure_node.min_peers(config)
    k = config.server.clients_per_round
    self.noised = (
      distributed_dp.min_clients(k, self.secure.threshold)
      if protection.distributed(config.privacy)
      else 0
    )
    self.transport, self.timeout, self.log = transport, timeout, log
    self.attempt = secrets.token_bytes(secure_node.ATTEMPT_BYTES)

  def _exchange(self, stage, asked, read, records=None, training=False):
    """`(client, read(reply, client))` of the stage's accepted replies, as
    they arrive."""
    reqs = [
      _request(
        self.by_client[c],
        stage,
        self.r,
        self.attempt,
        records(c) if records else None,
        training,
      )
      for c in asked
    ]
    got = _gather(
      self.transport, reqs, read, self.timeout, self.log, self.r, stage
    )
    for position, value in got:
      yield self.by_position[position], value

  def run(self, requests, r, template, weights):
    self.r = r
    self.by_client = {q.client: q for q in requests}
    self.by_position = {q.position: q.client for q in requests}
    ctx = secure_node.context(r, self.attempt)
    keys = dict(self._exchange('keys', sorted(self.by_client), _read_keys))
    _enough(len(keys), self.need + 1, 'advertised their keys', r)
    self.graph = secagg.neighbours(sorted(keys), self.degree, self.attempt)
    shares = self._share(keys)
    _enough(len(shares), self.need + 1, 'shared their secrets', r)
    self.senders = {
      c: [v for v in self.graph[c] if v in shares] for c in shares
    }
    # Every client has the graph's degree: its t is everyone's.
    t = secagg.threshold(len(self.graph[min(shares)]), self.secure.threshold)
    total, counts = self._mask(shares, template, weights)
    survivors = sorted(counts)
    _enough(len(survivors), t, 'sent their masked input', r)
    if self.noised:  # fewer would carry less noise than accounted
      _enough(len(survivors), self.noised, 'sent their noised input', r)
    revealed = self._unmask(set(survivors))
    dropped = sorted(set(shares) - set(survivors))
    s_pks = {c: keys[c][1] for c in keys}
    try:
      summed = secagg.unmask(
        total,
        survivors,
        dropped,
        self.graph,
        s_pks,
        revealed,
        t,
        self.secure.bits,
        ctx,
      )
    except secagg.ProtocolError as e:
      raise SecureRoundError(
        f'round {r + 1}: secure aggregation: {e}'
      ) from None
    failed = [q.client for q in requests if q.client not in counts]
    return _sums(summed, template, requests, counts), failed

  def _share(self, keys):
    graph = self.graph

    def peers(c):
      pks = {str(v): keys[v][0] + keys[v][1] for v in graph[c]}
      sigs = {str(v): keys[v][2] for v in graph[c]}
      return {'peers': ConfigRecord(pks), 'signatures': ConfigRecord(sigs)}

    def read(reply, c):
      got = {int(v): bytes(x) for v, x in reply['shares'].items()}
      if set(got) != set(graph[c]):
        raise codec.ReplyError('its shares are not one for each neighbour')
      return got

    return dict(self._exchange('share', sorted(keys), read, peers))

  def _mask(self, shares, template, weights):
    """`(sum, counts)`: the masked uploads summed as they arrive, and each
    survivor's counts."""
    senders = self.senders
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(template.extra))
    shape = {'y': jax.ShapeDtypeStruct((n,), np.uint32)}

    def incoming(c):
      return {
        'shares': ConfigRecord({str(v): shares[v][c] for v in senders[c]})
      }

    def read(reply, c):
      y = codec.decode(reply['masked'], shape)['y']
      got = types.ClientOutput(
        None,
        int(reply['counts']['num_examples']),
        np.float32(0),
        int(reply['counts']['num_steps']),
      )
      server.check_weights(weights, c, got)
      return y, got

    total, counts = np.zeros(n, np.uint32), {}
    replies = self._exchange('mask', sorted(shares), read, incoming, True)
    for c, (y, got) in replies:
      total += y  # wraps modulo 2^32
      counts[c] = got
    return total, counts

  def _unmask(self, alive):
    senders = self.senders

    def fates(c):
      return {
        'survivors': [v for v in senders[c] if v in alive],
        'dropped': [v for v in senders[c] if v not in alive],
      }

    def read(reply, c):
      got = {int(v): bytes(x) for v, x in reply['revealed'].items()}
      if set(got) != set(senders[c]) | {c}:
        raise codec.ReplyError(
          'its shares are not one for each sender and its own'
        )
      return got

    return dict(self._exchange('unmask', sorted(alive), read, fates))


def _enough(have: int, need: int, what: str, r: int) -> None:
  if have < need:
    raise SecureRoundError(
      f'round {r + 1}: secure aggregation needs {need} clients, {have} {what}'
    )


def _sums(
  summed: np.ndarray,
  template: Any,
  requests: Sequence[server.Request],
  counts: dict,
) -> types.Sums:
  """The survivors' sum as the upload's tree, and the round's scalars in
  sampled order (zeros for a client not summed, the losses NaN)."""
  leaves, treedef = jax.tree.flatten(template.extra)
  parts, start = [], 0
  for leaf in leaves:
    size = int(np.prod(leaf.shape))
    parts.append(summed[start : start + size].reshape(leaf.shape))
    start += size
  k = len(requests)
  examples = np.zeros(k, np.int32)
  steps = np.zeros(k, np.int32)
  for q in requests:
    if q.client in counts:
      examples[q.position] = counts[q.client].num_examples
      steps[q.position] = counts[q.client].num_steps
  return types.Sums(
    jax.tree.unflatten(treedef, parts),
    examples,
    np.full(k, np.nan, np.float32),
    steps,
  )
