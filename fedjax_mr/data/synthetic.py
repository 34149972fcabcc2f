"""Synthetic(α, β): federated data generated on demand, for 10⁶ clients.

The synthetic data of Li et al. (Section 5.1), also LEAF's synthetic set.
Client k draws

  u_k ~ N(0, α²),  B_k ~ N(0, β²),
  W_k ∈ R^{60×10}, b_k ∈ R^{10}: every entry ~ N(u_k, 1),
  v_k ∈ R^{60}: every entry ~ N(B_k, 1),

and each of its examples is x ~ N(v_k, Σ) with Σ diagonal, Σ_jj = j^−1.2
(j = 1..60), labelled y = argmax softmax(x W_k + b_k), which is
argmax(x W_k + b_k). α sets how much the clients' labelling models differ,
β how much their inputs do. α and β are standard deviations, the scale the
authors' generator draws with (the paper writes N(0, α)); at the paper's
Synthetic(1, 1) both readings agree.

Nothing is stored per example. Client k's parameters (u_k, B_k, W_k, b_k,
v_k) come from `fold_in(key, k)` and its example at position j from a
further `fold_in` of j (`examples`), so `SyntheticData.batch` generates the
examples a local step asks for inside the jitted round, and an example is
the same whichever batch asks for it. A run holds the N client sizes and
one key: 4 MB for 10⁶ clients.

Client sizes follow a power law, lognormal as in the paper (whose 30
clients hold 50 + ⌊LogNormal(4, 2)⌋ examples, some of them thousands).
Here (`client_sizes`) a client holds 10 + round(L) examples, L lognormal
with σ = 1 and mean 10, capped at 200: mean 19.98 (20 before the cap),
median 16, 1 client in 140 above 80, 3 in 10,000 at the cap. The cap
bounds what every client pays for the largest one: each epoch of local
training sorts a permutation of `max_size` positions, and a vmapped chunk
of clients runs as many steps as its largest client.

The test set (`held_out`): the paper keeps 20 % of every client's examples
for testing; with 10⁶ clients a run evaluates on a fixed sample instead:
up to 1,000 clients drawn by the seed, each with ⌈n_k / 4⌉ examples of its
own at positions n_k, n_k + 1, ... (a fifth of its n_k + ⌈n_k / 4⌉
examples, never a training example), at most 10,000 examples in all.

References:
  Li, Sahu, Zaheer, Sanjabi, Talwalkar and Smith, "Federated Optimization
  in Heterogeneous Networks", MLSys 2020 (FedProx), Section 5.1.
  Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018.
"""

from __future__ import annotations

import math
from typing import Any
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

NAME = 'synthetic'
NUM_FEATURES = 60
NUM_CLASSES = 10
# The diagonal of Σ: Σ_jj = j^−1.2, j = 1..60.
_VARIANCES = np.arange(1, NUM_FEATURES + 1, dtype=np.float64) ** -1.2

# Client sizes (see the module docstring).
MEAN_SIZE = 20.0
MIN_SIZE = 10
MAX_SIZE = 200
SIZE_SIGMA = 1.0
# The test set (see the module docstring).
TEST_CLIENTS = 1000
TEST_EXAMPLES = 10_000
TEST_FRACTION = 0.2

# fold_in tag of the data key of a seed ('SYN').
_DATA = 0x53594E
# fold_in tags of the two streams of a client's key (never drawn from
# itself).
_PARAMETERS, _EXAMPLES = 0, 1
# A client's parameters as one draw: u_k, B_k, then W_k, b_k and v_k.
_SPLITS = (
  NUM_FEATURES * NUM_CLASSES,
  NUM_FEATURES * NUM_CLASSES + NUM_CLASSES,
)
_PARAMS = 2 + NUM_FEATURES * NUM_CLASSES + NUM_CLASSES + NUM_FEATURES
# numpy streams of a seed: the sizes and the test clients.
_SIZES, _TEST = 1, 2


def client_sizes(
  num_clients: int,
  seed: int,
  *,
  mean: float = MEAN_SIZE,
  min_size: int = MIN_SIZE,
  max_size: int = MAX_SIZE,
  sigma: float = SIZE_SIGMA,
) -> np.ndarray:
  """Lognormal client sizes, the same for the same seed.

  Client k holds `min_size + round(L_k)` examples, capped at `max_size`,
  with L_k ~ LogNormal(μ, σ) and μ = ln(mean − min_size) − σ²/2 (so that
  E[L] = mean − min_size). The defaults give mean 19.98 (module
  docstring); 10⁶ sizes take about 50 ms.

  Args:
    num_clients: N ≥ 1.
    seed: numpy seed, in [0, 2**32).
    mean: the mean size before the cap, in (min_size, max_size).
    min_size: the smallest size, ≥ 1.
    max_size: the largest size.
    sigma: σ, the spread of log L, > 0.

  Returns:
    `[N]` int32 host array.

  Raises:
    ValueError: an argument out of its range (named).
  """
  if num_clients < 1:
    raise ValueError(f'num_clients must be ≥ 1, got {num_clients}')
  if min_size < 1:
    raise ValueError(f'min_size must be ≥ 1, got {min_size}')
  if not min_size < mean < max_size:
    raise ValueError(
      f'mean must lie in (min_size, max_size) = ({min_size}, {max_size}), '
      f'got {mean}'
    )
  if not (sigma > 0 and math.isfinite(sigma)):
    raise ValueError(f'sigma must be finite and > 0, got {sigma}')
  if num_clients * max_size >= 2**31:
    raise ValueError(
      f'num_clients={num_clients} clients of up to max_size={max_size} '
      'examples exceed int32 counts'
    )
  mu = math.log(mean - min_size) - sigma**2 / 2
  rng = np.random.default_rng([seed, _SIZES])
  extra = np.rint(rng.lognormal(mu, sigma, num_clients))
  return np.minimum(min_size + extra, max_size).astype(np.int32)


class ClientParams(NamedTuple):
  """One client's labelling model and input mean.

  Attributes:
    w: `[60, 10]` float32 W_k.
    b: `[10]` float32 b_k.
    v: `[60]` float32 v_k, the mean of its inputs.
  """

  w: jax.Array
  b: jax.Array
  v: jax.Array


def data_key(seed: int) -> jax.Array:
  """The key every client's stream is folded from (a seed's own stream,
  apart from the run's `fold_in(key(seed), r)` keys)."""
  return jax.random.fold_in(jax.random.key(seed), _DATA)


def client_params(
  key: jax.Array, alpha: Any, beta: Any, client_id: jax.Array
) -> ClientParams:
  """Client `client_id`'s W_k, b_k and v_k (module docstring); jit- and
  vmap-compatible.

  One draw of 672 standard normals from `fold_in(key, client_id)` (its
  parameter stream) gives, in this order, u_k / α, B_k / β and the
  deviations of W_k (row-major), b_k and v_k from their means (one random
  call: each costs compile time).
  """
  ck = jax.random.fold_in(key, client_id)
  z = jax.random.normal(
    jax.random.fold_in(ck, _PARAMETERS), (_PARAMS,), jnp.float32
  )
  u, b_mean = alpha * z[0], beta * z[1]
  w, b, v = jnp.split(z[2:], _SPLITS)
  return ClientParams(
    w=u + w.reshape(NUM_FEATURES, NUM_CLASSES), b=u + b, v=b_mean + v
  )


def examples(
  key: jax.Array,
  alpha: Any,
  beta: Any,
  client_id: jax.Array,
  positions: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """Client `client_id`'s examples at `positions` `[b]` (any ints ≥ 0):
  x `[b, 60]` float32, y `[b]` int32.

  The example at position j is v_k + Σ^½ z with z ~ N(0, I) drawn from
  `fold_in(example stream, j)`, the example stream of
  `fold_in(key, client_id)`: it does not depend on the other positions
  asked for.
  """
  params = client_params(key, alpha, beta, client_id)
  stream = jax.random.fold_in(jax.random.fold_in(key, client_id), _EXAMPLES)
  scale = jnp.asarray(np.sqrt(_VARIANCES), jnp.float32)

  def one(j):
    z = jax.random.normal(
      jax.random.fold_in(stream, j), (NUM_FEATURES,), jnp.float32
    )
    x = params.v + scale * z
    return x, jnp.argmax(x @ params.w + params.b).astype(jnp.int32)

  return jax.vmap(one)(positions)


@flax.struct.dataclass
class SyntheticData:
  """Synthetic(α, β) clients, generated on demand; stands in for a
  `ClientData` in local training and the round (`num_clients`,
  `max_size`, `sizes`, `batch`, `with_empty_client`).

  Attributes:
    key: the data key (`data_key`); client k's stream is
      `fold_in(key, k)`.
    alpha: float32 scalar α.
    beta: float32 scalar β.
    sizes: `[N]` int32 client sizes.
    max_size: the largest size (static).
  """

  key: jax.Array
  alpha: jax.Array
  beta: jax.Array
  sizes: jax.Array
  max_size: int = flax.struct.field(pytree_node=False, default=1)

  @property
  def num_clients(self) -> int:
    return self.sizes.shape[0]

  @property
  def num_examples(self) -> jax.Array:
    """Σ sizes, the training examples of all the clients (int32)."""
    return jnp.sum(self.sizes)

  def params(self, client_id: jax.Array) -> ClientParams:
    """Client `client_id`'s W_k, b_k and v_k."""
    return client_params(self.key, self.alpha, self.beta, client_id)

  def batch(
    self, client_id: jax.Array, positions: jax.Array
  ) -> tuple[jax.Array, jax.Array]:
    """Client `client_id`'s examples at `positions` `[b]` (each in
    `[0, max_size)`): x `[b, 60]` float32, y `[b]` int32. Positions past
    its size are examples of its own too (the caller masks them)."""
    return examples(self.key, self.alpha, self.beta, client_id, positions)

  def with_empty_client(self) -> SyntheticData:
    """The same clients and one more, id N, with no examples."""
    return self.replace(
      sizes=jnp.concatenate([self.sizes, jnp.zeros((1,), jnp.int32)])
    )


def check_rates(alpha: float, beta: float) -> None:
  """Raises `ValueError` naming `alpha` or `beta` unless finite and ≥ 0."""
  for name, value in (('alpha', alpha), ('beta', beta)):
    if not (math.isfinite(value) and value >= 0):
      raise ValueError(f'{name} must be finite and ≥ 0, got {value}')


def from_seed(
  num_clients: int,
  alpha: float,
  beta: float,
  seed: int,
  **size_args: Any,
) -> SyntheticData:
  """N Synthetic(α, β) clients of seed `seed`.

  Args:
    num_clients: N.
    alpha: α ≥ 0.
    beta: β ≥ 0.
    seed: in [0, 2**32); the sizes and every example follow from it.
    **size_args: `client_sizes`' keyword arguments (mean, min_size,
      max_size, sigma).

  Raises:
    ValueError: an argument out of its range (named).
  """
  check_rates(alpha, beta)
  sizes = client_sizes(num_clients, seed, **size_args)
  return SyntheticData(
    key=data_key(seed),
    alpha=jnp.float32(alpha),
    beta=jnp.float32(beta),
    sizes=jnp.asarray(sizes),
    max_size=int(sizes.max()),
  )


def held_out_positions(
  sizes: np.ndarray,
  seed: int,
  *,
  num_clients: int = TEST_CLIENTS,
  max_examples: int = TEST_EXAMPLES,
  fraction: float = TEST_FRACTION,
) -> tuple[np.ndarray, np.ndarray]:
  """Which examples make the test set: `(client ids [M], positions [M])`.

  Clients in a seeded random order, each with its ⌈n_k f / (1 − f)⌉
  held-out examples (f = `fraction`; positions n_k, n_k + 1, ...), as many
  clients as `num_clients` and `max_examples` allow (the first client
  always).
  """
  n = len(sizes)
  rng = np.random.default_rng([seed, _TEST])
  order = rng.choice(n, min(n, num_clients), replace=False)
  held = np.ceil(sizes[order] * (fraction / (1 - fraction))).astype(np.int64)
  total = np.cumsum(held)
  keep = max(1, int(np.searchsorted(total, max_examples, side='right')))
  order, held = order[:keep], held[:keep]
  ids = np.repeat(order, held).astype(np.int32)
  starts = np.repeat(np.cumsum(held) - held, held)
  positions = sizes[ids] + (np.arange(len(ids)) - starts)
  return ids, positions.astype(np.int32)


def held_out(data: SyntheticData, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """The fixed test set of `data` (module docstring): host arrays
  `(x [M, 60] float32, y [M] int32)`, M ≤ 10,000; `seed` picks the
  clients (the seed of `data`)."""
  ids, positions = held_out_positions(np.asarray(data.sizes), seed)
  # Padded to a power of two (each example is drawn on its own, so the
  # padding changes no bit of the others): one compiled generator serves
  # every data set of a bucket, where one of each M would compile anew.
  m = len(ids)
  padded = max(64, 1 << (m - 1).bit_length())
  pad = (0, padded - m)
  x, y = _generate(
    data.key,
    data.alpha,
    data.beta,
    jnp.asarray(np.pad(ids, pad)),
    jnp.asarray(np.pad(positions, pad)),
  )
  return np.asarray(x[:m, 0]), np.asarray(y[:m, 0])


@jax.jit
def _generate(key, alpha, beta, ids, positions):
  """`examples` of one position each: `(x [M, 1, 60], y [M, 1])`."""
  return jax.vmap(lambda k, j: examples(key, alpha, beta, k, j[None]))(
    ids, positions
  )


def summary(data: SyntheticData, alpha: float, beta: float) -> dict:
  """What partition.json records of the clients (JSON-serialisable; the
  sizes themselves follow from the seed)."""
  sizes = np.asarray(data.sizes)
  return {
    'num_clients': int(len(sizes)),
    'dataset': NAME,
    'alpha': float(alpha),
    'beta': float(beta),
    'num_examples': int(sizes.sum(dtype=np.int64)),
    'unassigned': 0,
    'size_min': int(sizes.min()),
    'size_max': int(sizes.max()),
    'size_mean': float(sizes.mean()),
  }
