"""Linear CKA between activations, and align-corners resizing (host, float64).

`linear_cka` is FedStitch's block-compatibility score (Eqs. 1–2, biased
HSIC with linear kernels) in its feature-space form

    CKA(X, Y) = ‖Ycᵀ Xc‖²_F / (‖Xcᵀ Xc‖_F · ‖Ycᵀ Yc‖_F),

with Xc, Yc the column-centred matrices, which equals the Gram form
tr(K H L H) / sqrt(tr(K H K H) tr(L H L H)) (K = XXᵀ, L = YYᵀ, H the
centring matrix) at O(n·C_X·C_Y) instead of O(n³) cost, so every row can be
used. Reductions are float64 on the host: the server ranks scores across
clients, and near ties must not depend on summation order.

How an activation `[N, ...]` becomes a matrix (`view`):
* 'positions' (default; StitchNet's, hence FedStitch's): every spatial (or
  sequence) position of every example is a row, `[N·H·W, C]`. Two maps of
  different size are compared at the smaller one's size: the larger is
  resized with align-corners bilinear interpolation (per axis, to the
  smaller size on that axis). A map against a vector: the map is globally
  average-pooled.
* 'flatten' (Kornblith et al.): one row per example, `[N, H·W·C]`.
* 'gap' (DeRy): one row per example, the spatial mean `[N, C]`.

References:
  Kornblith et al., "Similarity of Neural Network Representations
  Revisited", ICML 2019; Teerapittayanon et al., "StitchNet", 2023.
"""

from __future__ import annotations

import numpy as np

VIEWS = ('positions', 'flatten', 'gap')


def interp_matrix(n_in: int, n_out: int) -> np.ndarray:
  """`[n_out, n_in]` align-corners linear interpolation weights (float64).

  Output position o samples input coordinate o·(n_in − 1)/(n_out − 1) (PyTorch's
  `UpsamplingBilinear2d`, not `jax.image.resize`'s half-pixel centres).
  """
  r = np.zeros((n_out, n_in))
  if n_in == 1 or n_out == 1:
    r[:, 0] = 1.0
    return r
  src = np.arange(n_out) * (n_in - 1) / (n_out - 1)
  lo = np.minimum(np.floor(src).astype(int), n_in - 2)
  w = src - lo
  r[np.arange(n_out), lo] = 1 - w
  r[np.arange(n_out), lo + 1] += w
  return r


def resize(x, size, xp=np):
  """Align-corners (bi)linear resize of `[N, *spatial, C]` to `size`.

  Args:
    x: activations with one or two spatial/sequence axes.
    size: the target spatial shape.
    xp: the array module (`numpy` or `jax.numpy`).
  """
  size = tuple(int(s) for s in size)
  spatial = tuple(x.shape[1:-1])
  if len(size) != len(spatial):
    raise ValueError(f'cannot resize spatial shape {spatial} to {size}')
  for axis, (n_in, n_out) in enumerate(zip(spatial, size), start=1):
    if n_in == n_out:
      continue
    r = xp.asarray(interp_matrix(n_in, n_out), dtype=x.dtype)
    x = xp.moveaxis(xp.tensordot(r, xp.moveaxis(x, axis, 0), axes=1), 0, axis)
  return x


def global_pool(x):
  """Mean over all spatial/sequence axes: `[N, ..., C] → [N, C]`."""
  return x.mean(axis=tuple(range(1, x.ndim - 1))) if x.ndim > 2 else x


def as_matrices(x, y, view: str = 'positions'):
  """The two row-aligned float64 matrices CKA compares (see module doc)."""
  if view not in VIEWS:
    raise ValueError(f'view must be one of {VIEWS}, got {view!r}')
  x = np.asarray(x, dtype=np.float64)
  y = np.asarray(y, dtype=np.float64)
  if x.shape[0] != y.shape[0]:
    raise ValueError(
      f'CKA needs the same examples: {x.shape[0]} vs {y.shape[0]} rows'
    )
  n = x.shape[0]
  if view == 'flatten':
    return x.reshape(n, -1), y.reshape(n, -1)
  if view == 'gap' or x.ndim != y.ndim or x.ndim == 2:
    return global_pool(x), global_pool(y)
  size = tuple(min(a, b) for a, b in zip(x.shape[1:-1], y.shape[1:-1]))
  x, y = resize(x, size), resize(y, size)
  return x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])


def _cka_matrices(x: np.ndarray, y: np.ndarray, debiased: bool) -> float:
  n = x.shape[0]
  x = x - x.mean(axis=0)
  y = y - y.mean(axis=0)
  # Both products: CKA(X, Y) and CKA(Y, X) are one number, and a block
  # scored against a network and that network's block against the
  # block's model (the candidates after two start blocks, each with the
  # other's next block) tie exactly; a single product's summation order
  # follows the arguments' order and, on some CPUs' BLAS, parts such a
  # tie by an ulp, which then picks the surviving network by machine.
  xty = (np.sum((y.T @ x) ** 2) + np.sum((x.T @ y) ** 2)) / 2
  xtx = np.sum((x.T @ x) ** 2)
  yty = np.sum((y.T @ y) ** 2)
  if debiased:
    if n < 4:
      raise ValueError(f'debiased CKA needs at least 4 rows, got {n}')
    sx = np.sum(x * x, axis=1)
    sy = np.sum(y * y, axis=1)
    nx, ny = sx.sum(), sy.sum()

    def unbiased(dot, s1, s2, n1, n2):
      return dot - n / (n - 2) * (s1 @ s2) + n1 * n2 / ((n - 1) * (n - 2))

    xty = unbiased(xty, sx, sy, nx, ny)
    xtx = unbiased(xtx, sx, sx, nx, nx)
    yty = unbiased(yty, sy, sy, ny, ny)
    if xtx <= 0 or yty <= 0:
      return 0.0
  denom = np.sqrt(xtx) * np.sqrt(yty)
  if denom == 0 or not np.isfinite(denom):
    return 0.0
  return float(xty / denom)


def linear_cka(x, y, view: str = 'positions', debiased: bool = False) -> float:
  """Linear CKA of two activations of the same examples.

  Args:
    x: `[N, ...]` activations (numpy or jax; any float dtype).
    y: `[N, ...]` activations of the same N examples.
    view: 'positions', 'flatten' or 'gap' (see module doc).
    debiased: use the unbiased HSIC estimator (Székely–Rizzo U-statistic,
      as in Kornblith et al.'s reference) instead of the biased one.

  Returns:
    A float in [0, 1] (the debiased form can be slightly negative); 0 when
    either side has no variance.
  """
  return _cka_matrices(*as_matrices(x, y, view), debiased)


def linear_cka_gram(x, y) -> float:
  """The Gram (HKH) form of biased linear CKA on `[n, d]` matrices.

  O(n³); for tests and small n only.
  """
  x = np.asarray(x, np.float64)
  y = np.asarray(y, np.float64)
  x = x - x.mean(axis=0)  # H X: centring without forming H
  y = y - y.mean(axis=0)
  k = x @ x.T
  ll = y @ y.T
  denom = np.sqrt(np.sum(k * k) * np.sum(ll * ll))
  return 0.0 if denom == 0 else float(np.sum(k * ll) / denom)
