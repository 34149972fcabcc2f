"""FedGen: data-free knowledge distillation through a server-side generator.

The server keeps, beside the global model, a small conditional generator
G_w(eps, y) that maps uniform noise eps and a label y to a representation
z, the input of the classifier's head (the models are split at the head,
see `fedjax_mr.models.model.Model.apply_head`). A round:

1. The sampled clients receive the global model, the generator and the set
   of labels the last round's clients held. Each trains locally with the
   task loss plus two terms on generated representations (from round 1
   on, once the generator has been trained):

     loss = CE(f(x), y)
            + beta_t * KL( softmax(head(G(eps, y))) || softmax(f(x)) )
            + (S / B) * alpha_t * CE(head(G(eps', y')), y')

   where y are the batch's own labels, y' are S labels drawn uniformly from
   the held labels, alpha_t = max(1e-4, alpha * decay^t) and likewise
   beta_t (t the round), and the targets of the KL term are constants.
   Each client uploads its model and its label counts.
2. The server trains the generator for a number of Adam steps against the
   K uploaded heads: with label weights w_{k,y} = c_{k,y} / sum_j c_{j,y}
   (c: the uploaded label counts), for labels y drawn uniformly from the
   labels some client holds more than one example of,

     J(w) = ensemble_alpha * sum_k mean_i w_{k,y_i} CE(head_k(z_i), y_i)
            + ensemble_eta * exp(-mean_{i,j} d2(eps_i, eps_j) d1(z_i, z_j))

   with z_i = G(eps_i, y_i) (the second term is the generator's diversity
   loss: d2 is the mean
   squared difference of the noises, d1 the mean absolute difference of
   the outputs).
3. The global model is the FedAvg mean of the uploads, weighted by
   numbers of examples.

Where the paper leaves details open this follows the authors' code: the
teacher loss is the label-count-weighted sum of the K heads' losses (the
paper's Eq. 4 writes the loss of the mean of the heads' logits), labels
are drawn uniformly over the labels held rather than from the label
prior, the generator is Dense → BatchNorm → ReLU → Dense with the noise
concatenated to the one-hot label, trained in training mode and applied
by clients in inference mode; Adam with L2 weight decay as torch applies
it. Their adversarial student term (ensemble_beta) is 0 in all their
settings and is not built.

Defaults: the authors' MNIST/EMNIST settings: noise 32, hidden 256,
generator Adam lr 1e-4 with weight decay 1e-2, 50 generator steps of 32
samples a round, ensemble alpha 1 and eta 1, generative alpha 10 and beta
10 with decay 0.98, 32 synthetic samples per local step. (For CIFAR they
use hidden 512 and noise 64: `fedgen_hidden_dim`, `fedgen_noise_dim`.)

References:
  Zhu, Hong and Zhou, "Data-Free Knowledge Distillation for Heterogeneous
  Federated Learning", ICML 2021.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_mr.algorithms import fedavg
from fedjax_mr.core import errors
from fedjax_mr.core import tree
from fedjax_mr.core import types
from fedjax_mr.training import client

# A label takes part in generator training when some client holds more
# than this many of its examples (the authors' MIN_SAMPLES_PER_LABEL).
MIN_SAMPLES_PER_LABEL = 1
# Lower bound of the decayed client weights alpha_t, beta_t.
MIN_GENERATIVE_WEIGHT = 1e-4


class Generator(nn.Module):
  """(noise, label) → representation: Dense(hidden) → BatchNorm → ReLU →
  Dense(latent)."""

  num_classes: int
  hidden_dim: int
  latent_dim: int

  @nn.compact
  def __call__(self, eps, labels, train: bool = False):
    h = jnp.concatenate(
      [eps, jax.nn.one_hot(labels, self.num_classes, dtype=eps.dtype)], -1
    )
    h = nn.Dense(self.hidden_dim, name='fc')(h)
    # torch's BatchNorm1d defaults: momentum 0.1 (flax 0.9), eps 1e-5.
    h = nn.BatchNorm(
      use_running_average=not train, momentum=0.9, epsilon=1e-5, name='bn'
    )(h)
    return nn.Dense(self.latent_dim, name='representation')(nn.relu(h))


class FedGenState(NamedTuple):
  """Attributes:
  params: the global model.
  generator: the generator's variables (params and batch_stats).
  opt_state: its Adam state.
  labels: `[C]` float32, 1 for the labels the last round's clients held
    (what clients draw synthetic labels from), all 1 before round 1.
  trained: bool scalar, the generator has been trained at least once.
  """

  params: types.Variables
  generator: types.Variables
  opt_state: Any
  labels: jax.Array
  trained: jax.Array


def _at_least_one(name, value):
  if int(value) != value or value < 1:
    raise errors.ArgumentError(name, f'must be an integer >= 1, got {value}')


# Upper bounds of the generator's widths and batch sizes.
MAX_WIDTH = 65_536
MAX_BATCH = 2**20


@dataclasses.dataclass(frozen=True)
class Hparams:
  """FedGen's generator and its two loss weights on each side."""

  noise_dim: int = 32
  hidden_dim: int = 256
  generator_lr: float = 1e-4
  generator_weight_decay: float = 1e-2
  generator_steps: int = 50
  generator_batch_size: int = 32
  ensemble_alpha: float = 1.0
  ensemble_eta: float = 1.0
  generative_alpha: float = 10.0
  generative_beta: float = 10.0
  decay: float = 0.98
  synthetic_batch_size: int = 32

  def validate(self, **setting) -> None:
    """Raises `ArgumentError` naming a bad field (`setting`: unused)."""
    del setting
    for name in (
      'noise_dim',
      'hidden_dim',
      'generator_batch_size',
      'synthetic_batch_size',
    ):
      _at_least_one(name, getattr(self, name))
      # Bounded before the generator is built or a batch is drawn.
      bound = MAX_WIDTH if name.endswith('_dim') else MAX_BATCH
      if getattr(self, name) > bound:
        raise errors.ArgumentError(
          name, f'must be at most {bound:,}, got {getattr(self, name):,}'
        )
    if int(self.generator_steps) != self.generator_steps or (
      self.generator_steps < 0
    ):
      raise errors.ArgumentError(
        'generator_steps',
        f'must be an integer >= 0, got {self.generator_steps}',
      )
    errors.check_finite('generator_lr', self.generator_lr, positive=True)
    for name in (
      'generator_weight_decay',
      'ensemble_alpha',
      'ensemble_eta',
      'generative_alpha',
      'generative_beta',
    ):
      errors.check_finite(name, getattr(self, name))
    if not 0 < self.decay <= 1:
      raise errors.ArgumentError(
        'decay', f'must be in (0, 1], got {self.decay}'
      )


def label_counts(data: Any, client_id: jax.Array, num_classes: int):
  """`[C]` float32: how many of client `client_id`'s examples carry each
  label."""
  row = data.row(client_id)
  real = jnp.arange(row.shape[0]) < data.sizes[client_id]
  onehot = jax.nn.one_hot(data.y[row], num_classes, dtype=jnp.float32)
  return jnp.sum(onehot * real[:, None], axis=0)


def label_weights(counts: jax.Array) -> tuple[jax.Array, jax.Array]:
  """From the K uploaded label counts `[K, C]`: the weights w `[K, C]`
  (c_{k,y} / sum_j c_{j,y}, 0 for labels nobody holds) and the labels the
  generator trains on, `[C]` bool (some client holds more than
  `MIN_SAMPLES_PER_LABEL` of them)."""
  total = jnp.sum(counts, axis=0)
  weights = counts / jnp.where(total > 0, total, 1.0)
  qualified = jnp.max(counts, axis=0) > MIN_SAMPLES_PER_LABEL
  return weights, qualified


def diversity_loss(eps: jax.Array, z: jax.Array) -> jax.Array:
  """exp(-mean_{i,j} d2(eps_i, eps_j) * d1(z_i, z_j)) with d2 the mean
  squared and d1 the mean absolute difference (the authors' DiversityLoss
  with metric 'l1')."""
  noise = jnp.mean(jnp.square(eps[:, None] - eps[None]), axis=-1)
  layer = jnp.mean(jnp.abs(z[:, None] - z[None]), axis=-1)
  return jnp.exp(-jnp.mean(noise * layer))


def teacher_loss(
  head_logits: jax.Array, labels: jax.Array, weights: jax.Array
) -> jax.Array:
  """sum_k mean_i w[k, y_i] CE(logits[k, i], y_i).

  Args:
    head_logits: `[K, S, C]`, the K heads on the S generated samples.
    labels: `[S]` int.
    weights: `[K, C]` from `label_weights`.
  """
  ce = jax.vmap(
    lambda lg: optax.softmax_cross_entropy_with_integer_labels(lg, labels)
  )(head_logits)
  return jnp.sum(jnp.mean(ce * weights[:, labels], axis=1))


def client_regularizer(
  logits: jax.Array,
  mask: jax.Array,
  same_label_logits: jax.Array,
  synthetic_logits: jax.Array,
  synthetic_labels: jax.Array,
  alpha: jax.Array,
  beta: jax.Array,
  ratio: float,
) -> jax.Array:
  """The client's two terms on generated representations.

  Args:
    logits: `[B, C]` the model on the real batch.
    mask: `[B]` real examples.
    same_label_logits: `[B, C]` the model's head on G(eps, y_b) for the
      batch's labels (the KL targets; gradients do not flow into them).
    synthetic_logits: `[S, C]` the head on G(eps', y').
    synthetic_labels: `[S]` y'.
    alpha, beta: the round's weights.
    ratio: S / B.

  Returns:
    beta * KL(p_gen || p_real) (a sum over classes, mean over the real
    examples) + ratio * alpha * mean CE(synthetic_logits, y').
  """
  target = jax.nn.softmax(jax.lax.stop_gradient(same_label_logits))
  log_q = jax.nn.log_softmax(logits)
  kl = jnp.sum(
    jnp.where(target > 0, target * (jnp.log(target) - log_q), 0.0), axis=-1
  )
  kl = jnp.sum(kl * mask) / jnp.maximum(jnp.sum(mask), 1.0)
  ce = jnp.mean(
    optax.softmax_cross_entropy_with_integer_labels(
      synthetic_logits, synthetic_labels
    )
  )
  return beta * kl + ratio * alpha * ce


def decayed(weight: float, decay: float, round_index: jax.Array) -> jax.Array:
  """max(1e-4, weight * decay^round) (0 stays 0)."""
  if weight == 0:
    return jnp.float32(0)
  value = weight * jnp.power(
    jnp.float32(decay), round_index.astype(jnp.float32)
  )
  return jnp.maximum(jnp.float32(MIN_GENERATIVE_WEIGHT), value)


def generator_optimizer(hp: Hparams) -> optax.GradientTransformation:
  """Adam with L2 weight decay added to the gradient (torch's Adam)."""
  return optax.chain(
    optax.add_decayed_weights(hp.generator_weight_decay),
    optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8),
    optax.scale(-hp.generator_lr),
  )


def generate(
  generator: Generator,
  gen_vars: types.Variables,
  labels: jax.Array,
  key: jax.Array,
  noise_dim: int,
  train: bool = False,
) -> tuple[jax.Array, jax.Array, Any]:
  """Representations of `labels` `[S]` from fresh uniform noise.

  Returns:
    `(z [S, D], eps [S, noise_dim], state)`: `state` is the generator's
    updated `batch_stats` in training mode (`train`), None otherwise.
  """
  eps = jax.random.uniform(key, (labels.shape[0], noise_dim))
  if train:
    z, state = generator.apply(
      gen_vars, eps, labels, train=True, mutable=['batch_stats']
    )
    return z, eps, state
  return generator.apply(gen_vars, eps, labels), eps, None


def draw_labels(key: jax.Array, allowed: jax.Array, n: int) -> jax.Array:
  """`[n]` labels drawn uniformly from those where `allowed` `[C]` > 0."""
  logits = jnp.where(allowed > 0, 0.0, -jnp.inf)
  return jax.random.categorical(key, logits, shape=(n,))


def init_generator(
  generator: Generator, noise_dim: int, key: jax.Array
) -> dict[str, Any]:
  """The generator's variables (params and batch_stats), drawn from `key`."""
  gen_vars = generator.init(
    key, jnp.zeros((1, noise_dim)), jnp.zeros((1,), jnp.int32)
  )
  return dict(gen_vars)


def _representation_loss(
  model: Any, generator: Generator, hp: Hparams, ratio: float
) -> Callable:
  """The client's loss term on generated representations
  (`client_regularizer`), in the form `client.make_local_update` takes; its
  context is `(generator variables, labels held, alpha_t, beta_t, on)`."""
  noise_dim = int(hp.noise_dim)

  def representation_loss(feats, params, context, batch, key):
    gen_vars, allowed, alpha, beta, on = context
    head = {'params': params}
    logits = model.apply_head(head, feats)
    k_same, k_labels, k_synth = jax.random.split(key, 3)
    z_same, _, _ = generate(generator, gen_vars, batch.y, k_same, noise_dim)
    y_synth = draw_labels(k_labels, allowed, int(hp.synthetic_batch_size))
    z_synth, _, _ = generate(generator, gen_vars, y_synth, k_synth, noise_dim)
    reg = client_regularizer(
      logits,
      batch.mask,
      model.apply_head(head, jax.lax.stop_gradient(z_same)),
      model.apply_head(head, jax.lax.stop_gradient(z_synth)),
      y_synth,
      alpha,
      beta,
      ratio,
    )
    return jnp.where(on, reg, 0.0)

  return representation_loss


def train_generator(
  model: Any,
  generator: Generator,
  optimizer: optax.GradientTransformation,
  hp: Hparams,
  gen_vars: types.Variables,
  opt_state: Any,
  heads: types.Variables,
  weights: jax.Array,
  qualified: jax.Array,
  key: jax.Array,
) -> tuple[types.Variables, Any, jax.Array, jax.Array]:
  """`hp.generator_steps` Adam steps of the generator against the K heads.

  Args:
    model: the classifier (its `apply_head`).
    generator: the `Generator` module.
    optimizer: `generator_optimizer(hp)`.
    hp: the hyper-parameters.
    gen_vars: the generator's variables to start from.
    opt_state: the optimizer's state.
    heads: the K uploaded heads, `{'params': ...}` with leaves `[K, ...]`.
    weights: `[K, C]` and qualified: `[C]`, from `label_weights`.
    key: PRNG key; step i uses `fold_in(key, i)`.

  Returns:
    `(gen_vars, opt_state, teacher, diversity)`: the trained generator,
    the optimizer's state and the last step's two losses (0 without
    steps).
  """
  noise_dim = int(hp.noise_dim)

  def loss_fn(gen_params, stats, step_key):
    k_labels, k_noise = jax.random.split(step_key)
    labels = draw_labels(k_labels, qualified, int(hp.generator_batch_size))
    z, eps, new_stats = generate(
      generator,
      {'params': gen_params, **stats},
      labels,
      k_noise,
      noise_dim,
      train=True,
    )
    logits = jax.vmap(lambda v: model.apply_head(v, z))(heads)
    teacher = teacher_loss(logits, labels, weights)
    diversity = diversity_loss(eps, z)
    loss = hp.ensemble_alpha * teacher + hp.ensemble_eta * diversity
    return loss, (new_stats, teacher, diversity)

  def step(i, carry):
    params, stats, opt_state, _ = carry
    grads, (stats, teacher, diversity) = jax.grad(loss_fn, has_aux=True)(
      params, stats, jax.random.fold_in(key, i)
    )
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, dict(stats), opt_state, (teacher, diversity)

  stats = {c: v for c, v in gen_vars.items() if c != 'params'}
  zero = (jnp.float32(0), jnp.float32(0))
  params, stats, opt_state, (teacher, diversity) = jax.lax.fori_loop(
    0,
    int(hp.generator_steps),
    step,
    (gen_vars['params'], stats, opt_state, zero),
  )
  return {'params': params, **stats}, opt_state, teacher, diversity


def update_generator(
  model: Any,
  generator: Generator,
  optimizer: optax.GradientTransformation,
  hp: Hparams,
  state: FedGenState,
  outputs: types.ClientOutput,
  key: jax.Array,
) -> tuple[types.Variables, Any, jax.Array, jax.Array]:
  """The server's generator training of a round (`train_generator`).

  The label weights come from the uploaded label counts
  (`outputs.extra`, `[K, C]`), the teachers are the uploaded heads. Until
  the generator has been trained once (`state.trained`) it starts from
  fresh weights drawn from `key`; the rest of `key` drives the steps.
  """
  weights, qualified = label_weights(outputs.extra)
  heads = {'params': outputs.variables['params']}
  k_init, k_train = jax.random.split(key)
  fresh = init_generator(generator, int(hp.noise_dim), k_init)
  start = jax.tree.map(
    lambda old, new: jnp.where(state.trained, old, new),
    state.generator,
    fresh,
  )
  return train_generator(
    model,
    generator,
    optimizer,
    hp,
    start,
    state.opt_state,
    heads,
    weights,
    qualified,
    k_train,
  )


def fedgen(
  local: client.LocalTraining,
  clients_per_round: int,
  hp: Hparams = Hparams(),
  weighted: bool = True,
) -> types.Algorithm:
  """Builds FedGen.

  Args:
    local: how clients train; `local.model` must split at its head
      (`apply_train_features`, `apply_head`; every zoo model does).
    clients_per_round: K.
    hp: the generator and the loss weights (`Hparams`).
    weighted: the model mean by numbers of examples (the authors').

  Returns:
    An `Algorithm` with server state `FedGenState`. Uploads: the model and
    the label counts (`ClientOutput.extra`, `[C]`). Metrics:
    'bytes_communicated' (K models and K generators down, K models and
    label counts up), 'teacher_loss' and 'diversity_loss' (the last
    generator step's), 'generative_alpha' (alpha_t of the round).
  """
  hp.validate()
  return _fedgen(local, clients_per_round, hp, weighted)


def _fedgen(
  local: client.LocalTraining,
  clients_per_round: int,
  hp: Hparams = Hparams(),
  weighted: bool = True,
) -> types.Algorithm:
  """`fedgen` from validated hyper-parameters (the registry's `build`:
  the config layer validated them)."""
  k = errors.check_count('clients_per_round', clients_per_round)
  model = local.model
  num_classes = model.num_classes
  generator = Generator(num_classes, int(hp.hidden_dim), model.feature_dim())
  optimizer = generator_optimizer(hp)
  ratio = hp.synthetic_batch_size / local.batch_size
  noise_dim = int(hp.noise_dim)

  update = client.make_local_update(
    local,
    representation_loss=_representation_loss(model, generator, hp, ratio),
  )

  return types.Algorithm(
    functools.partial(_init, generator, optimizer, noise_dim, num_classes),
    functools.partial(_dispatch, hp),
    functools.partial(_client_update, update, num_classes),
    functools.partial(_aggregate, model, generator, optimizer, hp, k, weighted),
    clients_per_round=k,
  )


def _init(
  generator: Generator,
  optimizer: optax.GradientTransformation,
  noise_dim: int,
  num_classes: int,
  variables: types.Variables,
) -> FedGenState:
  # `init` has no key: this fixes the state's layout, and round 0's
  # aggregate draws the generator's actual initial weights from the
  # run's key before it first trains it (clients do not use it in round
  # 0).
  gen_vars = init_generator(generator, noise_dim, jax.random.key(0))
  return FedGenState(
    params=variables,
    generator=gen_vars,
    opt_state=optimizer.init(gen_vars['params']),
    labels=jnp.ones((num_classes,), jnp.float32),
    trained=jnp.zeros((), jnp.bool_),
  )


def _dispatch(
  hp: Hparams,
  state: FedGenState,
  client_ids: jax.Array,
  round_index: jax.Array,
  key: jax.Array,
) -> types.Dispatch:
  """The global model, and the generator with the round's loss weights."""
  del client_ids, key
  alpha = decayed(hp.generative_alpha, hp.decay, round_index)
  beta = decayed(hp.generative_beta, hp.decay, round_index)
  context = (state.generator, state.labels, alpha, beta, state.trained)
  return types.Dispatch(shared=(state.params, context))


def _client_update(
  update: Callable,
  num_classes: int,
  shared: Any,
  per_client: Any,
  client_state: Any,
  data: Any,
  client_id: jax.Array,
  key: jax.Array,
) -> tuple[types.ClientOutput, Any]:
  """Local training with the generator's loss; uploads the label counts."""
  del per_client
  variables, context = shared
  out = update(variables, data, client_id, key, context)
  counts = label_counts(data, client_id, num_classes)
  return out._replace(extra=counts), client_state


def _aggregate(
  model: Any,
  generator: Generator,
  optimizer: optax.GradientTransformation,
  hp: Hparams,
  k: int,
  weighted: bool,
  state: FedGenState,
  outputs: types.ClientOutput,
  client_ids: jax.Array,
  round_index: jax.Array,
  key: jax.Array,
) -> tuple[FedGenState, dict[str, jax.Array]]:
  """The generator's steps (`update_generator`), then the models' mean."""
  del client_ids
  gen_vars, opt_state, teacher, diversity = update_generator(
    model, generator, optimizer, hp, state, outputs, key
  )
  mean = fedavg.server_aggregate(outputs, weighted)
  num_classes = model.num_classes
  bytes_ = (
    2 * k * tree.nbytes(state.params)
    + k * tree.nbytes(state.generator)
    + k * num_classes * 4
  )
  metrics = {
    'bytes_communicated': jnp.float32(bytes_),
    'teacher_loss': teacher,
    'diversity_loss': diversity,
    'generative_alpha': decayed(hp.generative_alpha, hp.decay, round_index),
  }
  held = (jnp.sum(outputs.extra, axis=0) > 0).astype(jnp.float32)
  new_state = FedGenState(
    params=mean,
    generator=gen_vars,
    opt_state=opt_state,
    labels=held,
    trained=jnp.asarray(hp.generator_steps > 0),
  )
  return new_state, metrics


def build(setting: Any, hp: Hparams) -> types.Algorithm:
  """The registry's factory (see `fedjax_mr.pipeline.registry`)."""
  return _fedgen(setting.local, setting.clients_per_round, hp, setting.weighted)
