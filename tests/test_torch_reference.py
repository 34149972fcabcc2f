"""The benchmark's PyTorch loop does the same work as fedjax_mr's FedAvg.

Skipped where PyTorch (the optional `bench` extra) is not installed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.models import model as model_lib
from fedjax_mr.training import client
from fedjax_mr.training import engine
from fedjax_mr.training import optimizers
from tests import helpers

torch = pytest.importorskip('torch')
torch_reference = pytest.importorskip('experiments.torch_reference')


def test_one_fedavg_round_matches_fedjax_mr():
  # Batch 8 >= every client: one full batch per epoch, so the example order
  # (each side draws its own) does not matter and both take 2 steps each.
  sizes, lr, beta, epochs = [5, 7, 4], 0.05, 0.9, 2
  data, (x, y, parts) = helpers.toy_data(
    sizes, shape=(28, 28, 1), num_classes=10, seed=3
  )
  model = model_lib.get('cnn_mnist', 10, (28, 28, 1))
  variables = model.init(jax.random.key(0))
  local = client.LocalTraining(
    model, optimizers.sgd(lr, momentum=beta), epochs, 8
  )
  algorithm = fedavg.fedavg(local, 3, weighted=True)._replace(
    sampler=lambda key, r, s, d: jnp.arange(3, dtype=jnp.int32)
  )
  state = engine.init_state(algorithm, variables, 3)
  fn = jax.jit(engine.make_round_fn(algorithm, clients_per_round=3))
  state, metrics = fn(state, data, jax.random.key(1))

  loop = torch_reference.FedAvgLoop(
    'cnn_mnist', x, y, parts, 1 / 255, 0.0, 10, epochs, 8, lr, beta, 'cpu', 1
  )
  torch_reference.load_flax_cnn_mnist(loop.model, variables['params'])
  loop.set_global(loop.model.state_dict())
  before = {k: v.clone() for k, v in loop.state.items()}
  _, steps = loop.round([0, 1, 2])
  assert steps == int(metrics['num_steps']) == 3 * epochs

  expected = torch_reference.CNNMnist(1, 28, 10)
  torch_reference.load_flax_cnn_mnist(expected, state.server.params['params'])
  for name, want in expected.state_dict().items():
    got = loop.state[name].numpy()
    moved = np.abs(want.numpy() - before[name].numpy()).max()
    assert moved > 1e-4, name  # the round trained this tensor
    helpers.assert_close(got, want.numpy(), rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize(
  'name,classes,shape',
  [
    ('cnn_mnist', 10, (28, 28, 1)),
    ('cnn_cifar', 10, (32, 32, 3)),
    ('resnet20', 10, (32, 32, 3)),
    ('vgg16', 10, (32, 32, 3)),
    ('vgg16', 62, (28, 28, 1)),
  ],
)
def test_reference_models_count_our_parameters(name, classes, shape):
  ours = model_lib.get(name, classes, shape)
  v = jax.eval_shape(ours.init, jax.random.key(0))
  theirs = torch_reference.MODELS[name](shape[2], shape[0], classes)
  want = sum(a.size for a in jax.tree.leaves(v['params']))
  assert torch_reference.num_parameters(theirs) == want
  # Running statistics: BatchNorm buffers, our batch_stats.
  stats = sum(b.numel() for n, b in theirs.named_buffers() if 'running' in n)
  assert stats == sum(a.size for a in jax.tree.leaves(v.get('batch_stats', {})))
  logits = theirs.eval()(torch.zeros(2, shape[2], *shape[:2]))
  assert tuple(logits.shape) == (2, classes)
