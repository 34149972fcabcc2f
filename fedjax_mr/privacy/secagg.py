"""SecAgg+: the server learns the sum of the clients' vectors modulo 2^b
and nothing about one client's, also when clients drop out.

The protocol of Bell et al. (2020), one attempt of a round, each client
with a fresh 32-byte `seed` from which its secrets derive (`secrets_of`:
two X25519 keys and the seed of its self mask, by HKDF-SHA256):

0. advertise: client u sends its two public keys (`public_keys`): c_u
   (to encrypt shares) and s_u (to agree pairwise masks).
1. share: the server sends each client the keys of its neighbours
   (`neighbours`: a random Harary graph of even degree d, or every other
   client); u splits its self-mask seed b_u and its mask key's private
   half into t-of-d Shamir shares (`shamir`), one pair per neighbour v,
   each encrypted with AES-GCM under a key agreed from c_u and c_v
   (`share_keys`), bound to the round's `context` and to (u, v).
2. masked input: the server forwards to each client the shares
   addressed to it; u adds to its vector x_u (uint32, modulo 2^b) its
   self mask PRG(b_u) and, for every neighbour v whose shares it got,
   ±PRG(s_uv), + where u < v, with s_uv agreed from s_u and s_v, so each
   pair's masks cancel in the sum (`mask_input`).
3. unmask: the server names the survivors (the clients whose masked
   input arrived) and the dropped (the rest of those who shared); each
   client opens its shares and reveals, for each neighbour, the share of
   b_v if v survived, of v's mask key if v dropped, never both
   (`reveal`). The server rebuilds each survivor's b_u and each dropped
   client's mask key from t shares and strips their masks (`unmask`).

Each client holds a share of its own secrets too (d + 1 holders), so a
round whose t clients survive can rebuild every survivor's self mask.

Masks are ChaCha20 key streams (`prg`, from `cryptography`), keyed by
HKDF of a 256-bit secret with the round's context; no numpy or JAX
generator is involved. The server needs t of a client's d neighbours to
answer; t > d / 2 (`threshold`) keeps a server that lies about who
dropped from collecting both kinds of one client's shares.

References:
  Bonawitz et al. "Practical Secure Aggregation for Privacy-Preserving
  Machine Learning". CCS 2017.
  Bell, Bonawitz, Gascón, Lepoint, Raykova. "Secure Single-Server
  Aggregation with (Poly)Logarithmic Overhead". CCS 2020.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
from typing import Mapping
from typing import NamedTuple
from typing import Sequence

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import x25519
from cryptography.hazmat.primitives.ciphers import Cipher
from cryptography.hazmat.primitives.ciphers import algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedjax_mr.privacy import shamir

SEED_BYTES = 32
KEY_BYTES = 32
NONCE_BYTES = 12
_PAIR = struct.Struct('<II')  # (sender, receiver)


class ProtocolError(ValueError):
  """A message the protocol refuses, or a round it cannot finish; the
  message says which client and why."""


def new_seed() -> bytes:
  """A client's fresh seed for one attempt (`secrets`)."""
  return secrets.token_bytes(SEED_BYTES)


def _hkdf(material: bytes, info: bytes) -> bytes:
  return HKDF(hashes.SHA256(), KEY_BYTES, None, info).derive(material)


class Secrets(NamedTuple):
  """A client's secrets of one attempt.

  Attributes:
    c_key: its X25519 key for the shares' encryption.
    s_key: its X25519 key for the pairwise masks.
    self_seed: b_u, the seed of its self mask.
  """

  c_key: x25519.X25519PrivateKey
  s_key: x25519.X25519PrivateKey
  self_seed: bytes


def secrets_of(seed: bytes) -> Secrets:
  """The secrets a client's `seed` derives (HKDF-SHA256)."""
  if len(seed) != SEED_BYTES:
    raise ValueError(f'seed must be {SEED_BYTES} bytes, got {len(seed)}')
  raw = x25519.X25519PrivateKey.from_private_bytes
  return Secrets(
    raw(_hkdf(seed, b'fedjax_mr secagg c')),
    raw(_hkdf(seed, b'fedjax_mr secagg s')),
    _hkdf(seed, b'fedjax_mr secagg b'),
  )


def _public(key: x25519.X25519PrivateKey) -> bytes:
  return key.public_key().public_bytes(
    serialization.Encoding.Raw, serialization.PublicFormat.Raw
  )


def _private(key: x25519.X25519PrivateKey) -> bytes:
  return key.private_bytes(
    serialization.Encoding.Raw,
    serialization.PrivateFormat.Raw,
    serialization.NoEncryption(),
  )


def public_keys(seed: bytes) -> tuple[bytes, bytes]:
  """Stage 0: `(c_pk, s_pk)`, the client's two public keys (raw, 32
  bytes each)."""
  s = secrets_of(seed)
  return _public(s.c_key), _public(s.s_key)


def _agree(key: x25519.X25519PrivateKey, public: bytes, who: int) -> bytes:
  try:
    peer = x25519.X25519PublicKey.from_public_bytes(public)
    return key.exchange(peer)
  except ValueError:
    raise ProtocolError(f'client {who}: its public key is not valid') from None


def prg(seed: bytes, n: int, context: bytes, label: bytes) -> np.ndarray:
  """`[n]` uint32: the ChaCha20 key stream under HKDF(`seed`, `label` and
  `context`), little-endian words."""
  key = _hkdf(seed, b'fedjax_mr secagg mask ' + label + b'|' + context)
  stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
  return np.frombuffer(stream.update(bytes(4 * int(n))), '<u4').astype(
    np.uint32
  )


def _pair_mask(me: int, other: int, agreed: bytes, n: int, context: bytes):
  mask = prg(agreed, n, context, b'pair')
  return mask if me < other else np.uint32(0) - mask


def threshold(degree: int, fraction: float) -> int:
  """t, the shares that rebuild a secret of a client with `degree`
  neighbours, held by them and by the client (h = d + 1 holders):
  ceil(`fraction` · h), and more than h / 2."""
  if int(degree) < 1:
    raise ValueError(f'degree must be >= 1, got {degree}')
  if not 0.5 < fraction <= 1:
    raise ValueError(f'fraction must be in (1/2, 1], got {fraction}')
  h = int(degree) + 1
  return min(h, max(math.ceil(fraction * h), h // 2 + 1))


def neighbours(
  ids: Sequence[int], degree: int, seed: bytes
) -> dict[int, tuple[int, ...]]:
  """Each client's neighbours: every other client (`degree` 0, or one at
  least K - 1), else the Harary graph H(K, d) over the clients in an order
  drawn from `seed` (each client and the d / 2 before and after it on a
  ring; `degree` even)."""
  ids = [int(i) for i in ids]
  k = len(ids)
  if degree == 0 or degree >= k - 1:
    return {u: tuple(v for v in ids if v != u) for u in ids}
  if degree < 2 or degree % 2:
    raise ValueError(f'degree must be 0 or even and >= 2, got {degree}')
  ring = sorted(
    ids, key=lambda u: hashlib.sha256(seed + u.to_bytes(8, 'little')).digest()
  )
  half = degree // 2
  graph = {}
  for i, u in enumerate(ring):
    near = {ring[(i + j) % k] for j in range(-half, half + 1) if j}
    graph[u] = tuple(sorted(near))
  return graph


def _aad(context: bytes, sender: int, receiver: int) -> bytes:
  return context + _PAIR.pack(sender, receiver)


def _share_key(key, public, who: int, context: bytes) -> bytes:
  return _hkdf(_agree(key, public, who), b'fedjax_mr secagg share|' + context)


def share_keys(
  seed: bytes,
  me: int,
  peers: Mapping[int, tuple[bytes, bytes]],
  t: int,
  context: bytes,
) -> dict[int, bytes]:
  """Stage 1: `{v: ciphertext}` for each neighbour v in `peers` (`{v:
  (c_pk, s_pk)}`) and for u itself (`me`, kept by the client): the shares
  of b_u and of u's mask key held by v (x = v + 1), encrypted for v
  alone; any `t` of the d + 1 rebuild them."""
  if me in peers:
    raise ProtocolError(f'client {me}: named as its own neighbour')
  s = secrets_of(seed)
  everyone = {**peers, me: public_keys(seed)}
  holders = [v + 1 for v in sorted(everyone)]
  b_shares = shamir.split(s.self_seed, holders, t)
  s_shares = shamir.split(_private(s.s_key), holders, t)
  out = {}
  for v in sorted(everyone):
    key = _share_key(s.c_key, everyone[v][0], v, context)
    nonce = secrets.token_bytes(NONCE_BYTES)
    plain = _PAIR.pack(me, v) + b_shares[v + 1] + s_shares[v + 1]
    out[v] = nonce + AESGCM(key).encrypt(nonce, plain, _aad(context, me, v))
  return out


def open_share(
  seed: bytes,
  me: int,
  sender: int,
  sender_c_pk: bytes,
  ciphertext: bytes,
  context: bytes,
) -> tuple[bytes, bytes]:
  """`(b_share, s_share)` that `sender` encrypted for client `me`.

  Raises:
    ProtocolError: it does not open (forged, altered, of another round
      or pair).
  """
  key = _share_key(secrets_of(seed).c_key, sender_c_pk, sender, context)
  nonce, body = ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:]
  try:
    plain = AESGCM(key).decrypt(nonce, body, _aad(context, sender, me))
  except (InvalidTag, ValueError):
    raise ProtocolError(
      f'client {me}: the shares from client {sender} do not open'
    ) from None
  n = shamir.SHARE_BYTES
  if len(plain) != _PAIR.size + 2 * n or _PAIR.unpack(plain[: _PAIR.size]) != (
    sender,
    me,
  ):
    raise ProtocolError(f'client {me}: malformed shares from {sender}')
  body = plain[_PAIR.size :]
  return body[:n], body[n:]


def mask_input(
  seed: bytes,
  me: int,
  sharers: Mapping[int, bytes],
  values: np.ndarray,
  bits: int,
  context: bytes,
) -> np.ndarray:
  """Stage 2: `values` (`[n]` uint32) plus the self mask and the pairwise
  masks with every neighbour in `sharers` (`{v: s_pk}`: those whose
  shares reached u), modulo 2^`bits`."""
  values = np.asarray(values, np.uint32)
  if values.ndim != 1:
    raise ValueError(f'values must be one vector, got shape {values.shape}')
  s = secrets_of(seed)
  n = values.size
  y = values + prg(s.self_seed, n, context, b'self')
  for v in sorted(sharers):
    if v == me:
      raise ProtocolError(f'client {me}: named as its own neighbour')
    agreed = _agree(s.s_key, sharers[v], v)
    y = y + _pair_mask(me, v, agreed, n, context)
  return y & np.uint32(2**bits - 1)


def reveal(
  seed: bytes,
  me: int,
  senders: Mapping[int, tuple[bytes, bytes]],
  survivors: Sequence[int],
  dropped: Sequence[int],
  context: bytes,
) -> dict[int, bytes]:
  """Stage 3: `{v: share}` for u itself (it survived: the share of its
  b_u), for each sender v in `survivors` (the share of b_v) and in
  `dropped` (the share of v's mask key); `senders` maps u and each
  neighbour whose shares u got to `(c_pk, ciphertext)`.

  Raises:
    ProtocolError: a client named both survivor and dropped, u named
      dropped, a client whose shares u did not get, or shares that do not
      open.
  """
  alive, gone = set(map(int, survivors)) | {me}, set(map(int, dropped))
  if alive & gone:
    raise ProtocolError(
      f'client {me}: clients {sorted(alive & gone)} named both survived '
      'and dropped'
    )
  unknown = (alive | gone) - set(senders)
  if unknown:
    raise ProtocolError(
      f'client {me}: asked for shares of {sorted(unknown)}, whose shares '
      'it did not get'
    )
  out = {}
  for v in sorted(alive | gone):
    c_pk, ciphertext = senders[v]
    b_share, s_share = open_share(seed, me, v, c_pk, ciphertext, context)
    out[v] = b_share if v in alive else s_share
  return out


def _rebuild(kind, client, revealed, t) -> bytes:
  shares = {h + 1: r[client] for h, r in revealed.items() if client in r}
  if len(shares) < t:
    raise ProtocolError(
      f'client {client}: {len(shares)} shares of its {kind} arrived, {t} needed'
    )
  try:
    return shamir.combine(shares, t, KEY_BYTES)
  except ValueError:
    raise ProtocolError(
      f'client {client}: the shares of its {kind} do not combine'
    ) from None


def unmask(
  masked_total: np.ndarray,
  survivors: Sequence[int],
  dropped: Sequence[int],
  graph: Mapping[int, Sequence[int]],
  s_pks: Mapping[int, bytes],
  revealed: Mapping[int, Mapping[int, bytes]],
  t: int,
  bits: int,
  context: bytes,
) -> np.ndarray:
  """The survivors' sum: `masked_total` (the survivors' masked inputs
  summed, uint32) less each survivor's self mask and the masks it shares
  with each dropped neighbour, rebuilt from `revealed` (holder -> `{v:
  share}`), modulo 2^`bits`.

  Raises:
    ProtocolError: fewer than `t` shares of a secret needed, or shares
      that do not rebuild it.
  """
  total = np.asarray(masked_total, np.uint32).copy()
  n = total.size
  alive = set(map(int, survivors))
  for u in sorted(alive):
    seed = _rebuild('self mask', u, revealed, t)
    total = total - prg(seed, n, context, b'self')
  for v in sorted(set(map(int, dropped))):
    near = [w for w in graph[v] if w in alive]
    if not near:
      continue
    raw = _rebuild('mask key', v, revealed, t)
    key = x25519.X25519PrivateKey.from_private_bytes(raw)
    for w in near:
      total = total - _pair_mask(w, v, _agree(key, s_pks[w], w), n, context)
  return total & np.uint32(2**bits - 1)
