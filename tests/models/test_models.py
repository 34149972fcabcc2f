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
