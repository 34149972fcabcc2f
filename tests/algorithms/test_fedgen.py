import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import fedgen
from fedjax_mr.core import errors
from fedjax_mr.core import types
from fedjax_mr.training import engine
from tests import helpers
from tests.algorithms import contract


def test_label_counts_and_weights_by_hand():
  data, (x, y, parts) = helpers.toy_data([5, 9, 3], num_classes=3, seed=1)
  for c in range(3):
    got = fedgen.label_counts(data, jnp.int32(c), 3)
    np.testing.assert_array_equal(got, np.bincount(y[parts[c]], minlength=3))
  counts = jnp.array([[3.0, 0.0, 1.0], [1.0, 0.0, 1.0]])
  weights, qualified = fedgen.label_weights(counts)
  helpers.assert_close(weights, [[0.75, 0, 0.5], [0.25, 0, 0.5]])
  # Labels some client holds more than one example of.
  np.testing.assert_array_equal(qualified, [True, False, False])


def test_diversity_loss_by_hand():
  eps = jnp.array([[0.0], [1.0]])
  z = jnp.array([[0.0, 0.0], [1.0, 3.0]])
  # Noise distance (mean square) 1, output distance (mean abs) 2 off the
  # diagonal: exp(-(0 + 2 + 2 + 0) / 4).
  helpers.assert_close(fedgen.diversity_loss(eps, z), np.exp(-1.0))


def _ce(logits, label):
  logits = np.asarray(logits, np.float64)
  return np.log(np.exp(logits).sum()) - logits[label]


def test_teacher_loss_by_hand():
  logits = jnp.array(
    [[[2.0, 0.0], [0.0, 1.0]], [[-1.0, 1.0], [3.0, 3.0]]]
  )  # [K=2, S=2, C=2]
  labels = jnp.array([0, 1])
  weights = jnp.array([[0.2, 0.6], [0.8, 0.4]])
  want = sum(
    np.mean(
      [weights[k, labels[i]] * _ce(logits[k, i], labels[i]) for i in (0, 1)]
    )
    for k in (0, 1)
  )
  helpers.assert_close(
    fedgen.teacher_loss(logits, labels, weights), want, rtol=1e-6
  )


def test_client_regularizer_by_hand():
  logits = jnp.array([[1.0, 0.0], [0.0, 2.0], [5.0, 5.0]])
  mask = jnp.array([1.0, 1.0, 0.0])
  same = jnp.array([[0.0, 0.0], [1.0, 0.0], [9.0, -9.0]])
  synth = jnp.array([[0.5, -0.5]])
  y_synth = jnp.array([1])
  got = fedgen.client_regularizer(
    logits, mask, same, synth, y_synth, jnp.float32(3), jnp.float32(2), 0.25
  )

  def softmax(v):
    e = np.exp(np.asarray(v, np.float64))
    return e / e.sum()

  kl = [
    sum(p * (np.log(p) - np.log(q)) for p, q in zip(softmax(s), softmax(lg)))
    for s, lg in zip(same[:2], logits[:2])
  ]
  want = 2 * np.mean(kl) + 0.25 * 3 * _ce(synth[0], 1)
  helpers.assert_close(got, want, rtol=1e-5)


def test_decayed_weights():
  r = jnp.int32(3)
  helpers.assert_close(fedgen.decayed(10.0, 0.98, r), 10 * 0.98**3)
  helpers.assert_close(
    fedgen.decayed(1.0, 0.5, jnp.int32(40)), fedgen.MIN_GENERATIVE_WEIGHT
  )
  assert float(fedgen.decayed(0.0, 0.98, r)) == 0.0


def _run(algorithm, model, data, rounds=3, n=6):
  # Stacked (stream=False): FedGen's mean is FedAvg's stacked one.
  fn = helpers.program_jit(
    engine.make_round_fn(algorithm, clients_per_round=4, stream=False)
  )
  state = engine.init_state(algorithm, model.init(jax.random.key(0)), n)
  history = []
  for _ in range(rounds):
    state, metrics = fn(state, data, jax.random.key(4))
    history.append(jax.device_get(metrics))
  return jax.device_get(state), history


@pytest.fixture(scope='module')
def fedavg_run():
  # FedAvg's three rounds on the toy setup, the reference of the next two
  # tests (each ran it before).
  model = helpers.linear_bn_model()
  data, _ = helpers.toy_data([5, 9, 3, 12, 7, 4])
  return _run(fedavg.fedavg(contract.local_training(model), 4), model, data)


@pytest.mark.parametrize(
  'changes',
  [
    dict(generative_alpha=0.0, generative_beta=0.0),
    dict(generator_steps=0),
  ],
)
@pytest.mark.slow
def test_without_regularisation_it_is_fedavg_exactly(fedavg_run, changes):
  model = helpers.linear_bn_model()
  data, _ = helpers.toy_data([5, 9, 3, 12, 7, 4])
  local = contract.local_training(model)
  hp = fedgen.Hparams(**changes)
  gen_state, _ = _run(fedgen.fedgen(local, 4, hp), model, data)
  avg_state, _ = fedavg_run
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(gen_state.server))
  helpers.tree_equal(gen_state.server.params, avg_state.server.params)


@pytest.mark.slow
def test_regulariser_acts_from_round_one(fedavg_run):
  model = helpers.linear_bn_model()
  data, _ = helpers.toy_data([5, 9, 3, 12, 7, 4])
  local = contract.local_training(model)
  gen_hist = _run(fedgen.fedgen(local, 4), model, data)[1]
  avg_hist = fedavg_run[1]
  # Round 0 trains like FedAvg (no generator yet); from round 1 on the
  # clients' losses differ (the reported loss is the task loss alone).
  assert gen_hist[0]['train_loss'] == avg_hist[0]['train_loss']
  assert gen_hist[1]['train_loss'] != avg_hist[1]['train_loss']
  helpers.assert_close(
    [h['generative_alpha'] for h in gen_hist], [10, 9.8, 9.604], rtol=1e-6
  )
  # K = 4 models down and up, 4 generators down, 4 label counts up:
  # model params + batch stats; generator (32 noise + 3 labels) -> 256
  # with BatchNorm -> 6 features. (The contract: test_registry.)
  model = 4 * 6 + 6 + 2 * 6 + 2 * 6 + 6 * 3 + 3
  generator = 35 * 256 + 256 + 4 * 256 + 256 * 6 + 6
  want = (2 * 4 * model + 4 * generator) * 4 + 4 * 3 * 4
  assert all(h['bytes_communicated'] == want for h in gen_hist)


@pytest.mark.slow
def test_generator_learns_to_satisfy_fixed_heads():
  # Two clients' heads on the linear model (representation: the flattened
  # 2x2 input, 4 numbers), each trusted for the labels it holds.
  model = helpers.linear_model(num_classes=3)
  local = contract.local_training(model)
  hp = fedgen.Hparams(generator_lr=1e-2, generator_steps=1)
  algorithm = fedgen.fedgen(local, 2, hp)
  key = jax.random.key(3)
  heads = jax.vmap(model.init)(jax.random.split(key, 2))
  heads = jax.tree.map(lambda h: 3 * h, heads)
  outputs = types.ClientOutput(
    variables=heads,
    num_examples=jnp.array([10, 10]),
    loss=jnp.zeros(2),
    num_steps=jnp.ones(2, jnp.int32),
    extra=jnp.array([[8.0, 2.0, 0.0], [0.0, 2.0, 8.0]]),
  )
  state = algorithm.init(model.init(jax.random.key(0)))
  aggregate = jax.jit(algorithm.aggregate)
  generator = fedgen.Generator(3, 256, 4)
  labels = jnp.array([0, 2] * 50)
  eps = jax.random.uniform(jax.random.key(9), (100, 32))

  # Jitted: 40 eager passes dispatch each operation on its own.
  @jax.jit
  def accuracy_of(generator_variables):
    # Label 0 belongs to head 0, label 2 to head 1: how often the owner
    # classifies a generated representation as its label.
    z = generator.apply(generator_variables, eps, labels)
    owner = jnp.where(labels == 0, 0, 1)
    logits = jax.vmap(lambda h: model.apply_head(h, z))(heads)
    picked = logits[owner, jnp.arange(100)]
    return jnp.mean(jnp.argmax(picked, -1) == labels)

  def accuracy():
    return float(accuracy_of(state.generator))

  losses, accs = [], []
  for r in range(40):
    state, metrics = aggregate(
      state, outputs, jnp.arange(2), jnp.int32(r), jax.random.key(r)
    )
    losses.append(float(metrics['teacher_loss']))
    accs.append(accuracy())
  assert np.mean(losses[-5:]) < 0.25 * losses[0], losses
  assert accs[-1] >= 0.95 and accs[0] < 0.8, accs
  assert bool(state.trained)
  # Clients draw synthetic labels from those the round's clients held.
  np.testing.assert_array_equal(state.labels, [1, 1, 1])
  # The global model is FedAvg's mean of the uploads.
  helpers.assert_close(
    state.params, fedavg.server_aggregate(outputs, True), rtol=1e-6
  )


def test_bad_hparams_name_the_field():
  for changes, name in [
    (dict(decay=0.0), 'decay'),
    (dict(noise_dim=0), 'noise_dim'),
    (dict(generator_lr=-1.0), 'generator_lr'),
    (dict(generative_beta=float('nan')), 'generative_beta'),
    (dict(generator_steps=-1), 'generator_steps'),
  ]:
    hp = dataclasses.replace(fedgen.Hparams(), **changes)
    with pytest.raises(errors.ArgumentError, match=f'^{name} must be'):
      hp.validate()
