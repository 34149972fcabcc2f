import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.training import client
from fedjax_mr.training import optimizers
from tests import helpers


def test_epoch_permutation_prefix_is_a_permutation():
  for n in (1, 5, 7):
    perm = np.asarray(client.epoch_permutation(jax.random.key(n), 7, n))
    assert sorted(perm[:n]) == list(range(n))
    assert sorted(perm[n:]) == list(range(n, 7))


def _argsort_permutation(key, n_max, n):
  u = jax.random.uniform(key, (n_max,))
  u = jnp.where(jnp.arange(n_max) < n, u, 2.0 + jnp.arange(n_max))
  return jnp.argsort(u).astype(jnp.int32)


def test_epoch_permutation_packed_sort_is_the_uniforms_argsort():
  # Up to 256 positions one uint32 sort gives the order of the uniforms,
  # ties by position (8 of these 20,000 draws hold a tie).
  keys = jax.random.split(jax.random.key(3), 4000)
  for n_max in (1, 2, 33, 200, 256):
    n = jax.random.randint(jax.random.key(n_max), (4000,), 1, n_max + 1)
    got, want = (
      jax.jit(jax.vmap(f, (0, None, 0)), static_argnums=1)(keys, n_max, n)
      for f in (client.epoch_permutation, _argsort_permutation)
    )
    np.testing.assert_array_equal(got, want)


def _reference(model, opt, variables, data, parts, cid, key, epochs, b):
  """Plain Python loop: variable-size batches, the last one partial. Each
  step is jitted on its own (one program per batch size; run op by op it
  took seconds per test), the loop over epochs and batches stays here."""
  x_all, y_all = data
  idx = parts[cid]
  n = len(idx)
  params = variables['params']
  state = {k: v for k, v in variables.items() if k != 'params'}
  opt_state = opt.init(params)

  @jax.jit
  def step(params, state, opt_state, x, y):
    def loss_fn(p):
      logits, new_state = model.apply_train(
        {'params': p, **state}, x, jax.random.key(0)
      )
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
      return ce.mean(), new_state

    (loss, new_state), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, updates), new_state, opt_state, loss

  steps, loss_sum = 0, 0.0
  for e in range(epochs):
    ekey = jax.random.fold_in(key, e)
    perm = np.asarray(client.epoch_permutation(ekey, max(map(len, parts)), n))
    order = idx[perm[:n]]
    for j in range(-(-n // b)):
      batch = order[j * b : (j + 1) * b]
      x = jnp.asarray(x_all[batch], jnp.float32) / 255
      y = jnp.asarray(y_all[batch])
      params, new_state, opt_state, loss = step(params, state, opt_state, x, y)
      state = {**state, **new_state}
      steps += 1
      loss_sum += float(loss) * len(batch)
  return {'params': params, **state}, steps, loss_sum / (n * epochs)


@pytest.mark.slow
@pytest.mark.parametrize('batchnorm', [False, True])
@pytest.mark.parametrize('cid', [0, 1, 2])
def test_exact_steps_match_python_loop(cid, batchnorm):
  sizes = [7, 13, 3]  # partial last batches: 7 = 5 + 2, 13 = 5 + 5 + 3
  b, epochs = 5, 3
  # With BatchNorm, the padded rows of a partial batch must not enter the
  # batch statistics: the loop reference feeds the true, smaller batch.
  model = helpers.linear_bn_model() if batchnorm else helpers.linear_model()
  data, (x, y, parts) = helpers.toy_data(sizes)
  opt = optax.sgd(0.5, momentum=0.9)
  variables = model.init(jax.random.key(0))
  key = jax.random.key(42)
  update = jax.jit(
    client.make_client_update(model, opt, local_epochs=epochs, batch_size=b)
  )
  out = update(variables, data, jnp.int32(cid), key)
  ref_params, ref_steps, ref_loss = _reference(
    model, opt, variables, (x, y), parts, cid, key, epochs, b
  )
  assert int(out.num_steps) == ref_steps == epochs * -(-sizes[cid] // b)
  assert int(out.num_examples) == sizes[cid]
  if batchnorm:
    assert set(out.variables) == {'params', 'batch_stats'}
  helpers.assert_close(out.variables, ref_params, rtol=1e-4, atol=1e-5)
  helpers.assert_close(out.loss, ref_loss, rtol=1e-5)


def test_padding_examples_have_no_effect():
  # Client 0 of size 3 padded to n_max = 10: the padding index (0) points at
  # a real example; changing what it points at must not change the result.
  model = helpers.linear_model()
  data, _ = helpers.toy_data([3, 10])
  update = jax.jit(
    client.make_client_update(
      model, optax.sgd(0.1), local_epochs=2, batch_size=4
    )
  )
  variables = model.init(jax.random.key(1))
  out1 = update(variables, data, jnp.int32(0), jax.random.key(0))
  # Move client 0's examples to the end of the array: same examples, while
  # the padding entries now point at another client's data.
  x2 = jnp.concatenate([data.x[3:], data.x[:3]])
  y2 = jnp.concatenate([data.y[3:], data.y[:3]])
  data2 = client_data_lib.from_partition(
    np.asarray(x2),
    np.asarray(y2),
    [np.arange(10, 13), np.arange(10)],
    data.scale,
    data.shift,
  )
  # Client 0's row runs on into client 1's list (other examples).
  assert data2.row(0).tolist() == [10, 11, 12, *range(7)]
  out2 = update(variables, data2, jnp.int32(0), jax.random.key(0))
  helpers.assert_close(out1.variables, out2.variables, rtol=1e-6)


def test_masked_cross_entropy_weights_real_examples_only():
  logits = jnp.array([[0.0, 0.0], [10.0, -10.0], [3.0, 1.0]])
  labels = jnp.array([0, 1, 0])
  mean, total = client.masked_cross_entropy(
    logits, labels, jnp.array([1.0, 0.0, 1.0])
  )
  expected = [np.log(2), np.log1p(np.exp(-2.0))]
  helpers.assert_close(total, sum(expected), rtol=1e-6)
  helpers.assert_close(mean, np.mean(expected), rtol=1e-6)


def test_perturbations_by_hand():
  params = {'a': jnp.array([1.0, -2.0]), 'b': jnp.array([0.5])}
  grads = {'a': jnp.array([3.0, 0.0]), 'b': jnp.array([4.0])}
  eps = client.sam(0.5)(params, grads)  # 0.5 * g / 5
  helpers.assert_close(eps['a'], [0.3, 0.0], rtol=1e-6)
  helpers.assert_close(eps['b'], [0.4], rtol=1e-6)
  # ASAM, eta 0: T = |w| = (1, 2, 0.5); T g = (3, 0, 2), norm sqrt(13);
  # eps = rho T^2 g / ||T g||.
  eps = client.asam(1.0, 0.0)(params, grads)
  helpers.assert_close(eps['a'], [3 / 13**0.5, 0.0], rtol=1e-6)
  helpers.assert_close(eps['b'], [0.25 * 4 / 13**0.5], rtol=1e-6)
  # A leaf named 'bias' is not normalised (T = 1): with eta 0.5,
  # T = (1.5, 2.5) for the kernel, T g = (4.5, 0, 4), norm sqrt(36.25).
  layer = {'kernel': params['a'], 'bias': params['b']}
  eps = client.asam(2.0, 0.5)(
    {'Dense_0': layer}, {'Dense_0': {'kernel': grads['a'], 'bias': grads['b']}}
  )['Dense_0']
  norm = 36.25**0.5
  helpers.assert_close(eps['kernel'], [2 * 1.5**2 * 3 / norm, 0.0], rtol=1e-6)
  helpers.assert_close(eps['bias'], [2 * 4 / norm], rtol=1e-6)


@pytest.mark.slow
def test_two_pass_step_keeps_steps_and_rho_zero_is_plain_sgd():
  model = helpers.linear_bn_model()
  data, _ = helpers.toy_data([7, 13, 3])
  local = client.LocalTraining(model, optimizers.sgd(0.3), 2, 5)
  variables = model.init(jax.random.key(0))
  key, cid = jax.random.key(3), jnp.int32(1)
  jit = helpers.program_jit
  plain = jit(client.make_local_update(local))(variables, data, cid, key)
  outs = {
    rho: jit(
      client.make_local_update(local, perturbation=client.asam(rho, 0.01))
    )(variables, data, cid, key)
    for rho in (0.0, 0.5)
  }
  helpers.tree_equal(outs[0.0].variables, plain.variables)
  assert int(outs[0.5].num_steps) == int(plain.num_steps) == 2 * 3
  # The reported loss is taken at the unperturbed weights of the first pass.
  helpers.assert_close(outs[0.0].loss, plain.loss, rtol=1e-6)
  diff = jax.tree.map(
    lambda a, b: float(jnp.abs(a - b).max()),
    outs[0.5].variables['params'],
    plain.variables['params'],
  )
  assert max(jax.tree.leaves(diff)) > 1e-4
