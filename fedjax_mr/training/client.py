"""Local training of one client: exact step counts, no padding steps.

Client k with n_k examples runs E epochs of ceil(n_k / B) steps. Every epoch
draws a fresh permutation of its n_k examples; the last batch of an epoch
holds the n_k mod B leftover examples (when non-zero) and its loss is their
mean, as PyTorch's `DataLoader(drop_last=False)` gives. The step loop has a
data-dependent trip count, so a client never computes a step it does not
take (under `vmap` the lanes of a chunk run to the chunk's longest client;
see the engine's `client_chunk`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax

from fedjax_mr.core import types
from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.models import model as model_lib


def epoch_permutation(key: jax.Array, n_max: int, n: jax.Array) -> jax.Array:
  """A random order of positions `0..n-1` followed by `n..n_max-1`.

  Args:
    key: PRNG key.
    n_max: static row length.
    n: dynamic count of valid positions, `1 <= n <= n_max`.

  Returns:
    `[n_max]` int32; its first `n` entries are a uniform permutation of
    `range(n)`.
  """
  u = jax.random.uniform(key, (n_max,))
  u = jnp.where(jnp.arange(n_max) < n, u, 2.0 + jnp.arange(n_max))
  return jnp.argsort(u).astype(jnp.int32)


def masked_cross_entropy(
  logits: jax.Array, labels: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Returns (mean loss over real examples, sum of losses)."""
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  total = jnp.sum(losses * mask)
  return total / jnp.maximum(jnp.sum(mask), 1.0), total


def make_client_update(
  model: model_lib.Model,
  optimizer: optax.GradientTransformation,
  *,
  local_epochs: int,
  batch_size: int,
) -> types.ClientUpdate:
  """Builds plain local SGD for one client.

  A fresh optimizer state is made per call (momentum starts at zero), as in
  the papers' reference code.

  Args:
    model: the model.
    optimizer: e.g. `optax.sgd(0.01, momentum=0.9)`.
    local_epochs: E.
    batch_size: B.

  Returns:
    `client_update(variables, data, client_id, key) -> ClientOutput`, where
    `data` is a `ClientData` and `client_id` an int32 scalar.
  """

  def loss_fn(params, state, x, y, mask, key):
    logits, new_state = model.apply_train(
      {'params': params, **state}, x, key, mask=mask
    )
    mean_loss, total = masked_cross_entropy(logits, y, mask)
    return mean_loss, (new_state, total)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def client_update(variables, data, client_id, key):
    n_max = data.max_size
    b = min(batch_size, n_max)  # no client fills a larger batch
    row = data.indices[client_id]
    n = data.sizes[client_id]
    steps_per_epoch = (n + b - 1) // b
    params = variables['params']
    state = {k: v for k, v in variables.items() if k != 'params'}

    def epoch(e, carry):
      ekey = jax.random.fold_in(key, e)
      perm = epoch_permutation(ekey, n_max, n)
      perm = jnp.concatenate([perm, jnp.zeros((b,), perm.dtype)])

      def step(j, carry):
        params, state, opt_state, loss_sum = carry
        start = j * b
        pos = lax.dynamic_slice(perm, (start,), (b,))
        mask = (start + jnp.arange(b) < n).astype(jnp.float32)
        idx = row[pos]
        x = client_data_lib.normalize(data.x[idx], data.scale, data.shift)
        y = data.y[idx]
        skey = jax.random.fold_in(ekey, j)
        (_, (new_state, total)), grads = grad_fn(
          params, state, x, y, mask, skey
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        state = {**state, **new_state}
        return params, state, opt_state, loss_sum + total

      return lax.fori_loop(0, steps_per_epoch, step, carry)

    carry = (params, state, optimizer.init(params), jnp.zeros((), jnp.float32))
    params, state, _, loss_sum = lax.fori_loop(0, local_epochs, epoch, carry)
    seen = (n * local_epochs).astype(jnp.float32)
    return types.ClientOutput(
      variables={'params': params, **state},
      num_examples=n.astype(jnp.int32),
      loss=loss_sum / seen,
      num_steps=(steps_per_epoch * local_epochs).astype(jnp.int32),
    )

  return client_update
