"""The stitching projection between two blocks (FedStitch Eq. 3).

A stitch maps the incoming network's output X to the input Y that the next
block expects: an optional spatial step, then a per-position linear map
M (C_X × C_Y), with an optional bias (an affine fit, SN-Net style; no bias
by default, as FedStitch Eq. 3 and StitchNet).

* conv → conv: spatial policy 'match' (default) resizes X to Y's spatial
  size with align-corners bilinear interpolation in the fit *and* in the
  forward pass, so fit and use agree and every head sees the shapes it was
  built for; 'fit_only' (StitchNet) fits on the resized X but runs the next
  block at the incoming size (a block whose head needs a fixed size then
  cannot follow; such candidates are rejected before scoring).
* conv → dense: X is globally average-pooled first.
* dense → conv: rejected (`check_compatible`).

The fit is least squares in float64 from the sufficient statistics
G = XᵀX and B = XᵀY, rows being positions (N·H·W of them). Clients can
compute and upload (G, B) for their batch; the server adds them up and
solves once, which averages over all contributing clients and shares only
C×C statistics, never activations (our choice; the paper does not say who
fits M). `solve` uses the pseudo-inverse of G by eigendecomposition with a
relative eigenvalue cutoff (the minimum-norm least-squares solution, equal
to pinv(X)·Y) or a ridge; never an uncut float32 pseudo-inverse, which
blows up on the rank-deficient ReLU activations blocks produce.

References:
  FedStitch (2024) Eq. 3; Teerapittayanon et al., "StitchNet", 2023;
  Pan et al., "Stitchable Neural Networks", CVPR 2023 (affine fit).
"""

from __future__ import annotations

from typing import NamedTuple
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.stitch import cka

SPATIAL_POLICIES = ('match', 'fit_only')
SOLVERS = ('pinv', 'ridge')


class Stitch(NamedTuple):
  """A fitted stitching layer.

  Attributes:
    matrix: `[C_X, C_Y]` float32 projection M, or None (identity: a stitch
      that only pools or resizes, left after `fold`).
    bias: `[C_Y]` float32, or None.
    pool: globally average-pool X first (conv → dense).
    size: resize X to this spatial size in the forward pass, or None.
  """

  matrix: jax.Array | None
  bias: jax.Array | None = None
  pool: bool = False
  size: tuple[int, ...] | None = None


class Stats(NamedTuple):
  """Least-squares sufficient statistics (float64, host).

  Attributes:
    g: `[D, D]` XᵀX (D = C_X, plus 1 with a bias column).
    b: `[D, C_Y]` XᵀY.
    rows: number of rows summed.
  """

  g: np.ndarray
  b: np.ndarray
  rows: int

  def __add__(self, other: 'Stats') -> 'Stats':
    return Stats(self.g + other.g, self.b + other.b, self.rows + other.rows)


def check_compatible(
  x_spec: Sequence[int],
  y_spec: Sequence[int],
  policy: str = 'match',
) -> str | None:
  """Why an output of shape `x_spec` cannot be stitched to `y_spec`, or None.

  Only the shapes are checked here; under 'fit_only' the caller also checks
  that the block runs at the incoming spatial size.
  """
  if policy not in SPATIAL_POLICIES:
    raise errors.ConfigError(
      f'`policy`: unknown policy {policy!r}; choose one of '
      f'{", ".join(SPATIAL_POLICIES)}'
    )
  if len(x_spec) == 1 and len(y_spec) > 1:
    return 'dense → spatial stitching is not supported'
  if len(x_spec) > 1 and len(y_spec) > 1 and len(x_spec) != len(y_spec):
    return f'spatial ranks differ ({x_spec} vs {y_spec})'
  return None


def _prepare(x: np.ndarray, y_spec: Sequence[int], for_fit: bool, stitch_size):
  """X as the projection sees it: pooled, resized or unchanged."""
  if len(y_spec) == 1 and x.ndim > 2:
    return cka.global_pool(x)
  if x.ndim > 2 and (for_fit or stitch_size is not None):
    return cka.resize(x, y_spec[:-1])
  return x


def stats(x, y, *, bias: bool = False, policy: str = 'match') -> Stats:
  """(XᵀX, XᵀY) of one batch for fitting a stitch.

  Args:
    x: `[N, ...]` the incoming network's output on a batch.
    y: `[N, ...]` the input the next block sees in its own network, on the
      same batch.
    bias: append a column of ones to X (affine fit).
    policy: 'match' or 'fit_only' (both fit on the resized X).
  """
  y = np.asarray(y, np.float64)
  why = check_compatible(np.shape(x)[1:], y.shape[1:], policy)
  if why:
    raise ValueError(why)
  x = _prepare(np.asarray(x, np.float64), y.shape[1:], True, None)
  xr = x.reshape(-1, x.shape[-1])
  yr = y.reshape(-1, y.shape[-1])
  if bias:
    xr = np.concatenate([xr, np.ones((xr.shape[0], 1))], axis=1)
  return Stats(xr.T @ xr, xr.T @ yr, xr.shape[0])


def solve(
  s: Stats,
  *,
  solver: str = 'pinv',
  rcond: float = 1e-12,
  ridge: float = 1e-6,
) -> np.ndarray:
  """The least-squares projection `[D, C_Y]` (float64) from statistics.

  Args:
    s: summed statistics.
    solver: 'pinv' (minimum-norm solution: eigenvalues of G below
      `rcond`·max are dropped) or 'ridge' (solve (G + λI) M = B with
      λ = `ridge`·tr(G)/D).
    rcond: relative eigenvalue cutoff of 'pinv' (on G = XᵀX, i.e. on
      squared singular values of X).
    ridge: relative ridge strength.
  """
  if solver not in SOLVERS:
    raise errors.ConfigError(
      f'`solver`: unknown solver {solver!r}; choose one of {", ".join(SOLVERS)}'
    )
  g = (s.g + s.g.T) / 2
  if solver == 'ridge':
    lam = ridge * max(np.trace(g), 1e-300) / g.shape[0]
    return np.linalg.solve(g + lam * np.eye(g.shape[0]), s.b)
  w, v = np.linalg.eigh(g)
  top = w.max(initial=0.0)
  if top <= 0:
    return np.zeros_like(s.b)
  keep = w > rcond * top
  return (v[:, keep] / w[keep]) @ (v[:, keep].T @ s.b)


def layout(
  x_spec: Sequence[int], y_spec: Sequence[int], policy: str = 'match'
) -> tuple[bool, tuple[int, ...] | None]:
  """`(pool, size)` of the stitch between the two shapes: a global
  average pool (conv → dense), or the spatial size X is resized to in
  the forward pass (None: none)."""
  pool = len(y_spec) == 1 and len(x_spec) > 1
  size = None
  if not pool and len(x_spec) > 1 and policy == 'match':
    if tuple(x_spec[:-1]) != tuple(y_spec[:-1]):
      size = tuple(int(d) for d in y_spec[:-1])
  return pool, size


def make_stitch(
  m: np.ndarray,
  x_spec: Sequence[int],
  y_spec: Sequence[int],
  *,
  bias: bool = False,
  policy: str = 'match',
) -> Stitch:
  """A `Stitch` from a solved matrix and the two shapes it connects."""
  m = np.asarray(m)
  pool, size = layout(x_spec, y_spec, policy)
  return Stitch(
    matrix=jnp.asarray(m[:-1] if bias else m, jnp.float32),
    bias=jnp.asarray(m[-1], jnp.float32) if bias else None,
    pool=pool,
    size=size,
  )


def fit(
  x,
  y,
  *,
  bias: bool = False,
  policy: str = 'match',
  solver: str = 'pinv',
) -> Stitch:
  """Fits a stitch on one batch (X of the incoming net, Y of the block)."""
  m = solve(stats(x, y, bias=bias, policy=policy), solver=solver)
  return make_stitch(
    m, np.shape(x)[1:], np.shape(y)[1:], bias=bias, policy=policy
  )


def apply(stitch: Stitch, x: jax.Array) -> jax.Array:
  """Forward pass of a stitch: `[N, *x_spec] → [N, *y_spec']`."""
  if stitch.pool:
    x = cka.global_pool(x)
  elif stitch.size is not None:
    x = cka.resize(x, stitch.size, xp=jnp)
  y = x
  if stitch.matrix is not None:
    y = jnp.einsum('...c,cd->...d', x, stitch.matrix)
  if stitch.bias is not None:
    y = y + stitch.bias
  return y


def fold(stitch: Stitch, block):
  """Folds a bias-free stitch's matrix into the next block's first layer.

  Exact (to float rounding) because the block's first op is linear in its
  input channels: zero padding, resizing, pooling and flattening all
  commute with a per-position channel map. With a bias it would not be
  exact (zero padding of X·M + b is not X·M + b at the borders), so this
  raises.

  Args:
    stitch: a stitch without bias.
    block: a `blocks.Block` whose `fold` is not None.

  Returns:
    (resize-only stitch or None, the block with folded kernels and its
    `in_spec` channel count changed to C_X).
  """
  if stitch.bias is not None:
    raise ValueError('a stitch with a bias cannot be folded exactly')
  if block.fold is None:
    raise ValueError(f'{block.describe()} has no foldable first layer')
  kind, paths = block.fold
  m = stitch.matrix
  params = jax.tree.map(lambda a: a, block.variables['params'])
  for path in paths:
    node = params
    for key in path[:-1]:
      node = node[key]
    w = node[path[-1]]
    if kind == 'conv':
      w = jnp.einsum('ij,hwjo->hwio', m, w)
    elif kind == 'matrix':
      w = m @ w
    elif kind == 'flatten':
      c_y = m.shape[1]
      lead = w.shape[0] // c_y
      w = jnp.einsum('ij,pjo->pio', m, w.reshape(lead, c_y, -1))
      w = w.reshape(lead * m.shape[0], -1)
    else:
      raise ValueError(f'unknown fold kind {kind!r}')
    node[path[-1]] = w
  variables = dict(block.variables, params=params)
  in_spec = (*block.in_spec[:-1], int(m.shape[0]))
  rest = None
  if stitch.pool or stitch.size is not None:
    rest = Stitch(None, None, stitch.pool, stitch.size)
  return rest, block._replace(variables=variables, in_spec=in_spec)
