"""SecAgg+ (`privacy.secagg`, `privacy.shamir`): the sum of exactly the
survivors, masks a server cannot tell from uniform, shares below the
threshold that tell nothing, and messages that do not open."""

import secrets

import numpy as np
import pytest
from scipy import stats

from fedjax_mr.privacy import secagg
from fedjax_mr.privacy import shamir

CTX = b'test|1|' + bytes(16)


def test_shamir_any_t_shares_rebuild_and_fewer_do_not():
  secret = secrets.token_bytes(32)
  xs = [3, 8, 9, 12, 20]
  shares = shamir.split(secret, xs, 3)
  for pick in ([3, 8, 9], [9, 12, 20], [3, 12, 20]):
    assert shamir.combine({x: shares[x] for x in pick}, 3, 32) == secret
  two = {x: shares[x] for x in (3, 8)}
  with pytest.raises(ValueError, match='2 given, 3 needed'):
    shamir.combine(two, 3, 32)
  # The server tries with what it has: a line through two shares.
  try:
    guess = shamir.combine(two, 2, 32)
  except ValueError:
    guess = None  # not even a 32-byte value
  assert guess != secret
  # Two shares are consistent with any secret: through (0, s') and them
  # passes one polynomial of degree 2, whose value at a third holder
  # combines with them to s'.
  other = secrets.token_bytes(32)
  third = _through({0: other, **{x: two[x] for x in two}}, 12)
  assert shamir.combine({**two, 12: third}, 3, 32) == other


def _through(points, x):
  """The value at `x` of the polynomial through `points` ({x: bytes})."""
  p = shamir.PRIME
  ys = {k: int.from_bytes(v, 'big') for k, v in points.items()}
  total = 0
  for i, yi in ys.items():
    num = den = 1
    for j in ys:
      if j != i:
        num, den = num * (x - j) % p, den * (i - j) % p
    total = (total + yi * num * pow(den, -1, p)) % p
  return total.to_bytes(shamir.SHARE_BYTES, 'big')


def _round(ids, degree, fraction, values, bits, lost_share=(), lost_mask=()):
  """One attempt in process: `(sum, survivors)`; clients in `lost_share`
  drop before sharing, those in `lost_mask` before their masked input."""
  seeds = {u: secagg.new_seed() for u in ids}
  pks = {u: secagg.public_keys(seeds[u]) for u in ids}
  graph = secagg.neighbours(ids, degree, b'graph')
  t = secagg.threshold(len(graph[ids[0]]), fraction)
  sharers = [u for u in ids if u not in lost_share]
  cts = {
    u: secagg.share_keys(seeds[u], u, {v: pks[v] for v in graph[u]}, t, CTX)
    for u in sharers
  }
  alive = [u for u in sharers if u not in lost_mask]
  total = np.zeros(values[ids[0]].size, np.uint32)
  for u in alive:
    got = {v: pks[v][1] for v in graph[u] if v in cts}
    total += secagg.mask_input(seeds[u], u, got, values[u], bits, CTX)
  revealed = {}
  for h in alive:
    senders = {v: (pks[v][0], cts[v][h]) for v in graph[h] if v in cts}
    senders[h] = (pks[h][0], cts[h][h])
    revealed[h] = secagg.reveal(
      seeds[h],
      h,
      senders,
      [v for v in senders if v in alive and v != h],
      [v for v in senders if v not in alive],
      CTX,
    )
  s_pks = {u: pks[u][1] for u in ids}
  dropped = [u for u in sharers if u not in alive]
  out = secagg.unmask(
    total, alive, dropped, graph, s_pks, revealed, t, bits, CTX
  )
  return out, alive


@pytest.mark.parametrize(
  'degree, lost_share, lost_mask', [(0, (), ()), (4, (11,), (30,))]
)
@pytest.mark.parametrize('bits', [20, 32])
def test_the_sum_is_exactly_the_survivors(degree, lost_share, lost_mask, bits):
  ids = [3, 7, 11, 20, 21, 30, 41]
  rng = np.random.default_rng(bits)
  values = {
    u: rng.integers(0, 2**bits, 1000, dtype=np.uint64).astype(np.uint32)
    for u in ids
  }
  out, alive = _round(ids, degree, 0.51, values, bits, lost_share, lost_mask)
  want = sum(values[u].astype(np.uint64) for u in alive) % 2**bits
  np.testing.assert_array_equal(out, want.astype(np.uint32))
  assert set(alive) == set(ids) - set(lost_share) - set(lost_mask)


def _byte_p_values(words, bits):
  """The chi-squared p-value of each byte position of `words` (< 2^bits)
  being uniform."""
  out = []
  for shift in range(0, bits, 8):
    byte = ((words >> np.uint32(shift)) & np.uint32(0xFF)).astype(np.int64)
    out.append(stats.chisquare(np.bincount(byte, minlength=256)).pvalue)
  return out


@pytest.mark.parametrize('bits', [16, 32])
def test_a_masked_input_is_indistinguishable_from_uniform(bits):
  """What the server receives from one client: its values (all zeros but
  a pattern, as far from uniform as values get) plus masks; every byte
  position uniform by a chi-squared test at p = 1e-6 (the values alone
  fail it)."""
  n = 1 << 16
  x = np.zeros(n, np.uint32)
  x[::7] = 5
  seed = secagg.new_seed()
  peers = {9: secagg.public_keys(secagg.new_seed())[1]}
  y = secagg.mask_input(seed, 2, peers, x, bits, CTX)
  assert y.max() < 2**bits
  assert min(_byte_p_values(y, bits)) > 1e-6
  assert min(_byte_p_values(x, bits)) < 1e-6
  # And the masks of two clients' equal inputs are independent.
  other = secagg.mask_input(secagg.new_seed(), 2, peers, x, bits, CTX)
  assert abs(np.corrcoef(y.astype(float), other.astype(float))[0, 1]) < 0.03


def test_shares_of_a_forged_altered_or_other_round_message_do_not_open():
  a, b = secagg.new_seed(), secagg.new_seed()
  pa, pb = secagg.public_keys(a), secagg.public_keys(b)
  out = secagg.share_keys(a, 1, {2: pb}, 2, CTX)
  secagg.open_share(b, 2, 1, pa[0], out[2], CTX)  # opens
  flipped = bytearray(out[2])
  flipped[20] ^= 1
  cases = {
    'altered': (1, pa[0], bytes(flipped), CTX),
    'another round': (1, pa[0], out[2], b'test|2|' + bytes(16)),
    'another sender': (3, pa[0], out[2], CTX),
    'forged': (1, pa[0], secrets.token_bytes(len(out[2])), CTX),
    "another's key": (1, secagg.public_keys(b)[0], out[2], CTX),
  }
  for sender, key, ciphertext, ctx in cases.values():
    with pytest.raises(secagg.ProtocolError, match='do not open'):
      secagg.open_share(b, 2, sender, key, ciphertext, ctx)


def test_a_client_never_reveals_both_kinds_of_one_share():
  a, b = secagg.new_seed(), secagg.new_seed()
  pa, pb = secagg.public_keys(a), secagg.public_keys(b)
  ct = secagg.share_keys(a, 1, {2: pb}, 2, CTX)[2]
  with pytest.raises(secagg.ProtocolError, match='both survived and dropped'):
    secagg.reveal(b, 2, {1: (pa[0], ct)}, [1], [1], CTX)
  with pytest.raises(secagg.ProtocolError, match='did not get'):
    secagg.reveal(b, 2, {1: (pa[0], ct)}, [1, 5], [], CTX)
  with pytest.raises(secagg.ProtocolError, match='both survived'):
    secagg.reveal(b, 2, {1: (pa[0], ct)}, [], [2], CTX)  # itself dropped


def test_threshold_and_graph():
  assert secagg.threshold(4, 2 / 3) == 4  # of 5 holders
  assert secagg.threshold(4, 0.51) == 3
  assert secagg.threshold(9, 0.51) == 6  # more than half of 10
  with pytest.raises(ValueError, match='fraction'):
    secagg.threshold(4, 0.5)
  ids = list(range(10))
  graph = secagg.neighbours(ids, 4, b'x')
  assert all(len(v) == 4 and u not in v for u, v in graph.items())
  assert all(u in graph[v] for u in ids for v in graph[u])  # symmetric
  assert secagg.neighbours(ids, 4, b'y') != graph  # drawn from the seed
  assert secagg.neighbours(ids, 0, b'x')[3] == (0, 1, 2, 4, 5, 6, 7, 8, 9)
