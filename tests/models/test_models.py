import jax
import jax.numpy as jnp
import pytest

from fedjax_mr.core import errors
from fedjax_mr.core import tree
from fedjax_mr.models import model as model_lib


@pytest.mark.parametrize(
  'name,classes,shape,count',
  [
    ('cnn_mnist', 10, (28, 28, 1), 66_130),
    ('cnn_cifar', 10, (32, 32, 3), 62_006),
    ('cnn_femnist', 62, (28, 28, 1), 160_510),
    ('cnn_fedavg', 10, (28, 28, 1), 1_663_370),
  ],
)
@pytest.mark.slow
def test_parameter_counts_match_reference(name, classes, shape, count):
  m = model_lib.get(name, classes, shape)
  variables = m.init(jax.random.key(0))
  assert tree.num_parameters(variables['params']) == count
  logits = m.apply_eval(variables, jnp.zeros((3, *shape)))
  assert logits.shape == (3, classes)
  logits, state = m.apply_train(
    variables, jnp.zeros((3, *shape)), jax.random.key(1)
  )
  assert logits.shape == (3, classes) and state == {}


def test_unknown_model():
  with pytest.raises(errors.ConfigError, match='^`model`: unknown.*cnn_mnist'):
    model_lib.get('resnet1000', 10, (28, 28, 1))


def test_incompatible_input():
  with pytest.raises(errors.ConfigError, match='^`model=cnn_mnist` takes'):
    model_lib.get('cnn_mnist', 80, (80,))


def _matmul_dtypes(fn, *args) -> set:
  """The operand dtypes of every matrix product and convolution in
  `fn(*args)`'s jaxpr, sub-jaxprs (custom VJPs, loops) included."""
  found = set()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in ('dot_general', 'conv_general_dilated'):
        found.update(str(v.aval.dtype) for v in eqn.invars)
      for sub in jax.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.mark.slow
@pytest.mark.parametrize('name', ['cnn_mnist', 'resnet20'])
def test_bfloat16_policy_computes_in_bfloat16_with_float32_weights(name):
  shape = (28, 28, 1) if name == 'cnn_mnist' else (8, 8, 3)
  x = jax.random.normal(jax.random.key(2), (4, *shape))
  y = jnp.arange(4) % 10
  plain = model_lib.get(name, 10, shape)
  mixed = model_lib.get(name, 10, shape, compute_dtype='bfloat16')
  assert plain.compute_dtype is None  # off by default
  assert mixed.compute_dtype == jnp.bfloat16
  variables = plain.init(jax.random.key(0))
  # The master weights are float32 under the policy too.
  master = mixed.init(jax.random.key(0))
  assert {a.dtype for a in jax.tree.leaves(master)} == {jnp.dtype('float32')}

  def loss(model, params, rest):
    logits, state = model.apply_train(
      {**rest, 'params': params}, x, jax.random.key(1)
    )
    ce = -jax.nn.log_softmax(logits)[jnp.arange(4), y].mean()
    return ce, (logits, state)

  rest = {k: v for k, v in variables.items() if k != 'params'}
  params = variables['params']
  assert _matmul_dtypes(
    lambda p: jax.grad(lambda q: loss(plain, q, rest)[0])(p), params
  ) == {'float32'}
  assert _matmul_dtypes(lambda p: loss(mixed, p, rest)[0], params) == {
    'bfloat16'
  }
  want = jax.jit(plain.apply_eval)(variables, x)
  (_, (logits, state)), grads = jax.jit(
    jax.value_and_grad(lambda p: loss(mixed, p, rest), has_aux=True)
  )(params)
  # Outputs come back in float32, the gradients reach the float32 master
  # weights, and the running statistics stay float32.
  assert logits.dtype == jnp.float32
  for tree_ in (grads, state):
    assert {a.dtype for a in jax.tree.leaves(tree_)} <= {jnp.dtype('float32')}
  assert jax.tree.structure(state) == jax.tree.structure(rest)
  # bfloat16 keeps 8 bits of mantissa: close to float32, but not its bits
  # (both in evaluation: BatchNorm's running statistics at their start).
  got = jax.jit(mixed.apply_eval)(variables, x)
  assert got.dtype == jnp.float32
  assert not jnp.array_equal(got, want)
  scale = float(jnp.abs(want).max())
  assert float(jnp.abs(got - want).max()) < 0.05 * scale
  assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def test_unknown_compute_dtype():
  with pytest.raises(errors.ConfigError, match='^`compute_dtype`: unknown'):
    model_lib.get('cnn_mnist', 10, (28, 28, 1), compute_dtype='float16')
