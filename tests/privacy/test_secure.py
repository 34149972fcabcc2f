"""Secure aggregation's encoding around an algorithm (`privacy.secure`):
the round against a plain loop over the clients' integer uploads, the
decoded sum within the encoding's steps of the float sum, the hidden
losses, the flags, and the algorithms it refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import fedmr
from fedjax_mr.algorithms import fedmut
from fedjax_mr.algorithms import scaffold
from fedjax_mr.core import types
from fedjax_mr.privacy import fixed_point
from fedjax_mr.privacy import secure
from fedjax_mr.training import engine
from tests import helpers
from tests.algorithms import contract

SIZES = [5, 9, 3, 12, 7, 4]
K = 4


def _setting():
  model = helpers.linear_bn_model()
  data, _ = helpers.toy_data(SIZES)
  return model, data, contract.local_training(model)


def _make(name, local):
  return {
    'fedavg': lambda: fedavg.fedavg(local, K, weighted=True),
    'fedmut': lambda: fedmut.fedmut(local, K, weighted=True),
    'scaffold': lambda: scaffold.scaffold(local, K, 6, weighted=True),
  }[name]()


def _round(algorithm, model, data, key=4):
  fn = jax.jit(engine.make_round_fn(algorithm, clients_per_round=K))
  state = engine.init_state(algorithm, model.init(jax.random.key(0)), 6)
  return state, jax.device_get(fn(state, data, jax.random.key(key)))


def plain_round(wrapped, state, data, key=4):
  """`(server state, metrics, total)` of a round of `wrapped` as a plain
  loop: each client's update on its own (its loss not uploaded as it
  is), the uint32 uploads summed in reverse order, `wrapped`'s
  aggregate."""
  key = jax.random.key(key)
  ids = engine.make_sample_fn(wrapped, K)(state.replace(clients=()), data, key)
  _, k_dispatch, k_clients, k_aggregate = engine.round_keys(key, state.round)
  sent = wrapped.dispatch(state.server, ids, state.round, k_dispatch)
  keys = engine.client_keys(k_clients, clients_per_round=K)
  uploads, rows = [], []
  for p in range(K):
    row = jax.tree.map(lambda x: x[p], sent.per_client)
    cs = jax.tree.map(lambda x: x[ids[p]], state.clients)
    out, _ = jax.jit(wrapped.client_update)(
      sent.shared, row, cs, data, ids[p], keys[p]
    )
    assert np.isnan(float(out.loss))
    uploads.append(wrapped.contribution(out))
    rows.append(out)
  total = jax.tree.map(lambda *u: sum(reversed(u), jnp.uint32(0)), *uploads)
  sums = types.Sums(
    total,
    jnp.stack([o.num_examples for o in rows]),
    jnp.stack([o.loss for o in rows]),
    jnp.stack([o.num_steps for o in rows]),
  )
  want, want_metrics = jax.jit(wrapped.aggregate)(
    state.server, sums, ids, state.round, k_aggregate
  )
  return want, want_metrics, total


@pytest.mark.parametrize('name', ['fedavg', 'fedmut', 'scaffold'])
def test_the_round_is_the_aggregate_of_the_uploads_integer_sum(name):
  """The engine's round against a plain loop (`plain_round`): the same
  bits (an integer sum has no order)."""
  model, data, local = _setting()
  wrapped = secure.secure(_make(name, local), 32, 50.0, max(SIZES))
  state, (new, metrics) = _round(wrapped, model, data)
  want, want_metrics, _ = plain_round(wrapped, state, data)
  helpers.tree_equal(new.server, want)
  for m in ('train_loss', 'secagg_clipped'):
    np.testing.assert_array_equal(metrics[m], want_metrics[m])


@pytest.mark.parametrize('name', ['fedavg', 'fedmut', 'scaffold'])
def test_the_decoded_sum_is_the_float_sum_within_the_steps(name):
  model, data, local = _setting()
  bound, bits = 50.0, 32
  inner = _make(name, local)
  wrapped = secure.secure(inner, bits, bound, max(SIZES))
  state, (plain, plain_metrics) = _round(inner, model, data)
  _, (new, metrics) = _round(wrapped, model, data)
  # K codes, each within a step (and float32's rounding of x / step) of
  # its value: the mean of models within about that over the weights.
  step = bound / fixed_point.levels(bits, K)
  for a, b in zip(
    jax.tree.leaves(new.server.params), jax.tree.leaves(plain.server.params)
  ):
    assert np.abs(a - b).max() < 1e-5
    assert np.abs(a - b).max() > 0 or step < 1e-9
  helpers.assert_close(
    metrics['train_loss'], plain_metrics['train_loss'], rtol=1e-5
  )
  assert int(metrics['secagg_clipped']) == 0
  assert np.isnan(metrics['client_loss']).all()


def test_a_small_range_clips_and_says_how_many_clients():
  """Every client's weight n_k (3 to 12) exceeds a range of 2.5: all K
  clipped; a range of 50 clips none (the test above)."""
  model, data, local = _setting()
  tight = secure.secure(_make('fedavg', local), 32, 2.5, max(SIZES))
  _, (_, metrics) = _round(tight, model, data)
  assert int(metrics['secagg_clipped']) == K


def test_a_non_finite_value_stops_the_run_as_diverged():
  model, data, local = _setting()
  inner = _make('fedavg', local)

  def poisoned(shared, row, cs, data, cid, key):
    out, st = inner.client_update(shared, row, cs, data, cid, key)
    bad = jax.tree.map(lambda v: jnp.where(cid == 3, jnp.nan, v), out.variables)
    return out._replace(variables=bad), st

  wrapped = secure.secure(
    inner._replace(client_update=poisoned), 32, 50.0, max(SIZES)
  )
  state, (_, metrics) = _round(wrapped, model, data)
  ids = list(np.asarray(metrics['client_ids']))
  assert np.isnan(metrics['train_loss']) == (3 in ids)


def test_refused_algorithms_and_arguments():
  model, _, local = _setting()
  variables = model.init(jax.random.key(0))
  with pytest.raises(ValueError, match='reads every client model'):
    secure.check(fedmr.fedmr(local, K), variables)
  secure.check(_make('scaffold', local), variables)
  counted = _make('fedavg', local)._replace(
    contribution=lambda out: {'n': out.num_examples}
  )
  with pytest.raises(ValueError, match='holds a int32 leaf'):
    secure.check(counted, variables)
  with pytest.raises(ValueError, match='bound must be'):
    secure.secure(_make('fedavg', local), 32, float('inf'), 10)
  with pytest.raises(ValueError, match='max_examples'):
    secure.secure(_make('fedavg', local), 32, 1.0, 0)
  with pytest.raises(ValueError, match='cannot hold a sum of k=4'):
    secure.secure(_make('fedavg', local), 3, 1.0, 10)
