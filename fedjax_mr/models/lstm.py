"""The character LSTM of the FedMut paper's Shakespeare task.

Embedding(80, 8) → 2-layer LSTM(256) → dense(256 → 80) on the last time
step: the next character of an 80-character window over LEAF's 80-character
vocabulary. 819,920 parameters, counted as PyTorch counts `nn.LSTM`.

PyTorch's LSTM layer has two bias vectors, `b_ih` and `b_hh`, where one
would do (they are only ever added). Flax's `LSTMCell` has one (inside its
hidden-to-hidden dense), which would give 815,824 parameters. `LSTMLayer`
keeps both, so the count, the leaves (FedMR and FedMut treat each leaf as a
"layer": `w_ih`, `w_hh`, `b_ih`, `b_hh`, in PyTorch's `state_dict` order)
and the training dynamics (both biases receive the same gradient, so their
sum moves at twice the learning rate) match the reference.

The input-to-hidden products of all time steps are one matrix product
before the time loop; the loop (`lax.scan`) does only the recurrent one.

References:
  Hochreiter & Schmidhuber, "Long Short-Term Memory", 1997; Caldas et al.,
  "LEAF: A Benchmark for Federated Settings", 2018 (task and vocabulary);
  Hu et al., "FedMut: Generalized Federated Learning via Stochastic
  Mutation", AAAI 2024.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax


class LSTMLayer(nn.Module):
  """One LSTM layer over a whole sequence, PyTorch's parameterisation.

  Gates in PyTorch's order (input, forget, cell, output):
  `gates = x_t @ w_ih + b_ih + h_{t-1} @ w_hh + b_hh`. Kernels use Flax's
  LSTM initialisers (LeCun normal input kernel, orthogonal recurrent
  kernel, zero biases).

  Attributes:
    hidden: H.
  """

  hidden: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """`x` `[B, T, D]` → hidden states `[B, T, H]` (zero initial state)."""
    h4 = 4 * self.hidden
    w_ih = self.param('w_ih', nn.initializers.lecun_normal(), (x.shape[-1], h4))
    w_hh = self.param('w_hh', nn.initializers.orthogonal(), (self.hidden, h4))
    b_ih = self.param('b_ih', nn.initializers.zeros_init(), (h4,))
    b_hh = self.param('b_hh', nn.initializers.zeros_init(), (h4,))
    x_gates = jnp.einsum('btd,dg->tbg', x, w_ih) + (b_ih + b_hh)

    def step(carry, xg):
      h, c = carry
      gates = xg + h @ w_hh
      i, f, g, o = jnp.split(gates, 4, axis=-1)
      c = nn.sigmoid(f) * c + nn.sigmoid(i) * jnp.tanh(g)
      h = nn.sigmoid(o) * jnp.tanh(c)
      return (h, c), h

    zeros = jnp.zeros((x.shape[0], self.hidden), x_gates.dtype)
    _, hs = lax.scan(step, (zeros, zeros), x_gates)
    return jnp.swapaxes(hs, 0, 1)


class CharLSTM(nn.Module):
  """Embedding(V, 8) → LSTM(256) ×2 → dense(256 → C) on the last step.

  Attributes:
    num_classes: C, also the vocabulary size V (next-character prediction).
    embed_dim: 8.
    hidden: 256.
    num_layers: 2.
  """

  num_classes: int
  embed_dim: int = 8
  hidden: int = 256
  num_layers: int = 2

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    train: bool = False,
    mask: jax.Array | None = None,
    *,
    features_only: bool = False,
    from_features: bool = False,
  ) -> jax.Array:
    """`x` `[B, T]` integer token ids → logits `[B, C]`."""
    del train, mask  # no dropout, no BatchNorm
    if not from_features:
      h = nn.Embed(self.num_classes, self.embed_dim, name='embed')(
        x.astype(jnp.int32)
      )
      for i in range(self.num_layers):
        h = LSTMLayer(self.hidden, name=f'lstm{i}')(h)
      x = h[:, -1]
      if features_only:
        return x
    return nn.Dense(self.num_classes, name='fc')(x)
