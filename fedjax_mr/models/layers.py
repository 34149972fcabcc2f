"""CPU-friendly convolution and pooling layers.

XLA:CPU lowers the weight gradient of a convolution inside a loop
(``lax.scan``/``while_loop``) into a slow naive loop nest (JAX issue 12868),
and the backward pass of ``nn.max_pool`` is a slow select-and-scatter.
Local training runs every step inside such a loop, so the models of this
package use the layers below: the forward values are those of
``lax.conv_general_dilated`` and ``nn.max_pool``; only the way the
gradient is computed differs.

`conv2d`'s gradient has two implementations, chosen when a function is
traced (`conv_implementation`):

* 'im2col' (the default on CPU): under differentiation the forward pass
  gathers the input's windows into a patch matrix `[N·H'·W', kh·kw·C_in]`
  and multiplies it by the kernel; the backward pass is two matrix
  products (patchesᵀ · dy for the kernel, dy · kernelᵀ for the patches)
  and a sum of the patch gradients back onto their input positions. On
  XLA:CPU matrix products run much faster than the small convolutions of
  these models (cnn_mnist's training step ~1.5×, resnet20's ~2× faster on
  2 cores; BUILD.md, "Benchmark"), at the cost of keeping the patch matrix
  (kh·kw times the input) until the backward pass.
* 'conv' (the default elsewhere; GPUs have fast convolution kernels):
  the backward pass as ordinary convolutions in the layout XLA:CPU keeps
  fast inside loops.

Both give the values of `lax.conv_general_dilated` and its gradient up to
float32 rounding (summation order); a function not differentiated always
runs `lax.conv_general_dilated`. On XLA:CPU with several host devices the
'conv' gradient is not bit-reproducible (its backward convolutions change
their results in the last digits when another device's execution runs
beside them; BUILD.md, "Reproducibility"); the 'im2col' one is.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Iterator
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

_DIMS = ('NHWC', 'HWIO', 'NHWC')


def _pad_pairs(
  padding: str | Sequence[tuple[int, int]],
  kernel: Sequence[int],
  strides: Sequence[int],
  in_hw: Sequence[int],
) -> tuple[tuple[int, int], ...]:
  """Explicit (low, high) padding for 'VALID', 'SAME' or explicit pairs."""
  if isinstance(padding, str):
    return tuple(lax.padtype_to_pads(in_hw, kernel, strides, padding.upper()))
  return tuple((int(lo), int(hi)) for lo, hi in padding)


CONV_IMPLEMENTATIONS = ('auto', 'im2col', 'conv')
_setting = threading.local()


@contextlib.contextmanager
def conv_implementation(name: str) -> Iterator[None]:
  """Within the block, functions traced use `name` for `conv2d`'s gradient:
  'im2col', 'conv' or 'auto' (im2col on CPU, conv elsewhere; the default).
  It applies when a function is traced, so a `jax.jit` function already
  compiled keeps the implementation it was traced with."""
  if name not in CONV_IMPLEMENTATIONS:
    raise ValueError(
      f'conv implementation {name!r}: not one of {CONV_IMPLEMENTATIONS}'
    )
  before = getattr(_setting, 'name', 'auto')
  _setting.name = name
  try:
    yield
  finally:
    _setting.name = before


def conv_gradient() -> str:
  """The gradient `conv2d` gets if traced now: 'im2col' or 'conv'."""
  name = getattr(_setting, 'name', 'auto')
  if name == 'auto':
    return 'im2col' if jax.default_backend() == 'cpu' else 'conv'
  return name


def _im2col_now() -> bool:
  return conv_gradient() == 'im2col'


def conv2d(x, w, strides=(1, 1), padding=((0, 0), (0, 0))):
  """2-D convolution, NHWC input, HWIO kernel, explicit padding pairs.

  Args:
    x: input `[N, H, W, C_in]`.
    w: kernel `[kh, kw, C_in, C_out]`.
    strides: window strides `(sh, sw)`.
    padding: `((lo_h, hi_h), (lo_w, hi_w))`.

  Returns:
    `[N, H', W', C_out]`, equal to `lax.conv_general_dilated` (its gradient
    by the implementation `conv_implementation` selects).
  """
  strides = tuple(int(s) for s in strides)
  padding = tuple((int(lo), int(hi)) for lo, hi in padding)
  if _im2col_now():
    return _conv2d_im2col(x, w, strides, padding)
  return _conv2d_conv(x, w, strides, padding)


def _stock_conv(x, w, strides, padding):
  return lax.conv_general_dilated(
    x, w, strides, padding, dimension_numbers=_DIMS
  )


# --- The 'im2col' gradient -------------------------------------------------


def _window_slices(kh, kw, ho, wo, strides):
  """For each kernel position (i, j), row-major, the strided slices of the
  padded input that it meets in the `ho × wo` output windows."""
  sh, sw = strides
  for i in range(kh):
    for j in range(kw):
      yield (
        slice(None),
        slice(i, i + (ho - 1) * sh + 1, sh),
        slice(j, j + (wo - 1) * sw + 1, sw),
        slice(None),
      )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv2d_im2col(x, w, strides, padding):
  return _stock_conv(x, w, strides, padding)


def _im2col_fwd(x, w, strides, padding):
  kh, kw, c_in, c_out = w.shape
  xp = jnp.pad(x, ((0, 0), padding[0], padding[1], (0, 0)))
  ho = (xp.shape[1] - kh) // strides[0] + 1
  wo = (xp.shape[2] - kw) // strides[1] + 1
  # [N, H', W', kh·kw·C_in], features in the kernel's (i, j, c) order.
  patches = jnp.concatenate(
    [xp[s] for s in _window_slices(kh, kw, ho, wo, strides)], axis=-1
  )
  cols = patches.reshape(-1, kh * kw * c_in)
  y = (cols @ w.reshape(-1, c_out)).reshape(x.shape[0], ho, wo, c_out)
  return y.astype(x.dtype), (cols, w, xp.shape, x.shape)


def _im2col_bwd(strides, padding, res, dy):
  cols, w, padded_shape, x_shape = res
  kh, kw, c_in, c_out = w.shape
  n, ho, wo, _ = dy.shape
  dy2 = dy.reshape(-1, c_out)
  dw = (cols.T @ dy2).reshape(w.shape).astype(w.dtype)
  dcols = (dy2 @ w.reshape(-1, c_out).T).reshape(n, ho, wo, kh * kw, c_in)
  dxp = jnp.zeros(padded_shape, dy.dtype)
  for k, s in enumerate(_window_slices(kh, kw, ho, wo, strides)):
    dxp = dxp.at[s].add(dcols[:, :, :, k, :])
  (lo_h, _), (lo_w, _) = padding
  dx = dxp[:, lo_h : lo_h + x_shape[1], lo_w : lo_w + x_shape[2], :]
  return dx.astype(cols.dtype), dw


_conv2d_im2col.defvjp(_im2col_fwd, _im2col_bwd)


# --- The 'conv' gradient ---------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv2d_conv(x, w, strides, padding):
  return _stock_conv(x, w, strides, padding)


def _conv2d_fwd(x, w, strides, padding):
  return _stock_conv(x, w, strides, padding), (x, w)


def _conv2d_bwd(strides, padding, res, dy):
  x, w = res
  kh, kw = w.shape[0], w.shape[1]
  # Input gradient: a full convolution of the stride-dilated dy with the
  # spatially flipped kernel whose in/out axes are swapped.
  pads_dx = []
  for size, out, k, s, (lo, _) in zip(
    x.shape[1:3], dy.shape[1:3], (kh, kw), strides, padding
  ):
    pads_dx.append((k - 1 - lo, size - (out - 1) * s + lo - 1))
  dx = lax.conv_general_dilated(
    dy,
    jnp.transpose(w[::-1, ::-1], (0, 1, 3, 2)),
    window_strides=(1, 1),
    padding=pads_dx,
    lhs_dilation=strides,
    dimension_numbers=_DIMS,
  ).astype(x.dtype)
  # Weight gradient as a plain convolution in the canonical NHWC/HWIO
  # layout (XLA:CPU keeps its fast convolution only for that layout inside
  # loops): the channels of x become the batch axis, its batch axis is
  # contracted as the feature axis, and dy (dilated by the forward stride)
  # is the kernel. The transposes are materialised on purpose.
  xp = jnp.pad(x, ((0, 0), padding[0], padding[1], (0, 0)))
  dw = lax.conv_general_dilated(
    jnp.transpose(xp, (3, 1, 2, 0)),  # [C_in, H, W, N]
    jnp.transpose(dy, (1, 2, 0, 3)),  # [H', W', N, C_out]
    window_strides=(1, 1),
    padding='VALID',
    rhs_dilation=strides,
    dimension_numbers=_DIMS,
  )
  # dw: [C_in, >=kh, >=kw, C_out]; crop the windows past the kernel (present
  # when the stride leaves a remainder) and move to HWIO.
  dw = dw[:, :kh, :kw, :]
  return dx, jnp.transpose(dw, (1, 2, 0, 3)).astype(w.dtype)


_conv2d_conv.defvjp(_conv2d_fwd, _conv2d_bwd)


class Conv(nn.Module):
  """Drop-in `nn.Conv` (NHWC, 2-D, no dilation, no groups) using `conv2d`.

  Parameter names and shapes (`kernel` HWIO, `bias`) and initialisers are
  those of `flax.linen.Conv`, so checkpoints and parameter counts agree.
  """

  features: int
  kernel_size: tuple[int, int]
  strides: tuple[int, int] = (1, 1)
  padding: str | Sequence[tuple[int, int]] = 'SAME'
  use_bias: bool = True
  kernel_init: nn.initializers.Initializer = nn.linear.default_kernel_init
  bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.param(
      'kernel',
      self.kernel_init,
      (*self.kernel_size, x.shape[-1], self.features),
    )
    pads = _pad_pairs(
      self.padding, self.kernel_size, self.strides, x.shape[1:3]
    )
    y = conv2d(x, kernel.astype(x.dtype), tuple(self.strides), pads)
    if self.use_bias:
      bias = self.param('bias', self.bias_init, (self.features,))
      y = y + bias.astype(y.dtype)
    return y


def max_pool_2x2(x: jax.Array) -> jax.Array:
  """2×2 max-pool with stride 2 ('VALID') by reshape and max.

  Equals `nn.max_pool(x, (2, 2), (2, 2))` for `[N, H, W, C]` inputs (odd
  trailing rows/columns are dropped, as 'VALID' does). Its gradient goes to
  the maximum of each window (to every tied maximum).
  """
  n, h, w, c = x.shape
  h2, w2 = h // 2, w // 2
  x = x[:, : 2 * h2, : 2 * w2, :].reshape(n, h2, 2, w2, 2, c)
  return x.max(axis=(2, 4))


# PyTorch's BatchNorm defaults: running = 0.9 · running + 0.1 · batch, ε 1e-5.
BN_MOMENTUM = 0.9
BN_EPSILON = 1e-5


def batch_norm(
  x: jax.Array,
  train: bool,
  mask: jax.Array | None,
  name: str | None = None,
) -> jax.Array:
  """`nn.BatchNorm` over all but the last axis, as the zoo uses it.

  Call it inside a compact module: it creates the BatchNorm there. PyTorch's
  momentum (0.1, i.e. Flax `momentum=0.9`) and ε; statistics live in the
  `batch_stats` collection. In training the batch statistics exclude the
  padded rows of a client's partial last batch. (Flax updates the running
  variance with the biased batch variance, PyTorch with the unbiased one.)

  Args:
    x: `[B, ...]` activations.
    train: batch statistics (and update the running ones) when True, else
      the running statistics.
    mask: `[B]` float mask of real examples, or None (all real).
    name: the module's name.
  """
  if train and mask is not None:
    mask = mask.reshape(mask.shape[0], *([1] * (x.ndim - 1))) > 0
  else:
    mask = None
  return nn.BatchNorm(
    use_running_average=not train,
    momentum=BN_MOMENTUM,
    epsilon=BN_EPSILON,
    name=name,
  )(x, mask=mask)
