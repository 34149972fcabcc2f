"""CPU-friendly convolution and pooling layers.

XLA:CPU lowers the weight gradient of a convolution inside a loop
(``lax.scan``/``while_loop``) into a slow naive loop nest (JAX issue 12868),
and the backward pass of ``nn.max_pool`` is a slow select-and-scatter.
Local training runs every step inside such a loop, so the models of this
package use the layers below: the forward values are those of
``lax.conv_general_dilated`` and ``nn.max_pool``; only the way the backward
pass is written differs (ordinary convolutions; reshape-and-max pooling).
"""

from __future__ import annotations

import functools
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def conv2d(x, w, strides=(1, 1), padding=((0, 0), (0, 0))):
  """2-D convolution, NHWC input, HWIO kernel, explicit padding pairs.

  Args:
    x: input `[N, H, W, C_in]`.
    w: kernel `[kh, kw, C_in, C_out]`.
    strides: window strides `(sh, sw)`.
    padding: `((lo_h, hi_h), (lo_w, hi_w))`.

  Returns:
    `[N, H', W', C_out]`, equal to `lax.conv_general_dilated`.
  """
  return lax.conv_general_dilated(
    x, w, strides, padding, dimension_numbers=_DIMS
  )


def _conv2d_fwd(x, w, strides, padding):
  return conv2d(x, w, strides, padding), (x, w)


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


conv2d.defvjp(_conv2d_fwd, _conv2d_bwd)


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
