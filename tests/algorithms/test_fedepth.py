import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import fedepth
from fedjax_mr.core import errors
from fedjax_mr.core import tree
from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.models import model as model_lib
from fedjax_mr.pipeline import checks
from fedjax_mr.training import client
from fedjax_mr.training import optimizers
from tests import helpers
from tests.algorithms import contract


class Layer(nn.Module):
  """Dense → (masked BatchNorm) → ReLU: one residual-block stand-in."""

  features: int
  bn: bool

  @nn.compact
  def __call__(self, h, train, mask):
    h = nn.Dense(self.features, name='dense')(h)
    if self.bn:
      m = None if mask is None else (mask[:, None] > 0)
      h = nn.BatchNorm(not train, momentum=0.8, name='bn')(h, mask=m)
    return nn.relu(h)


class TinyChain(nn.Module):
  """A stem, three layers named as the zoo ResNets' blocks (widths 2, 3,
  4) and a head, with the zoo's features_only / from_features split."""

  num_classes: int = 3
  bn: bool = False

  @nn.compact
  def __call__(
    self, x, train=False, mask=None, *, features_only=False, from_features=False
  ):
    if not from_features:
      h = nn.Dense(2, name='stem')(x.reshape(x.shape[0], -1))
      for i, width in enumerate((2, 3, 4)):
        h = Layer(width, self.bn, name=f'layer{i + 1}_0')(h, train, mask)
      if features_only:
        return h
      x = h
    return nn.Dense(self.num_classes, name='head')(x)


def tiny(bn=False):
  return model_lib.Model('tiny_chain', TinyChain(bn=bn), (2, 2, 1), 3)


def _sgd(model, lr=0.5, epochs=1, batch=8):
  return client.LocalTraining(model, optimizers.sgd(lr), epochs, batch)


def test_layout_of_the_tiny_chain_and_the_zoo_resnet18():
  layout = fedepth.layout_of(tiny())
  assert layout.layers == ('layer1_0', 'layer2_0', 'layer3_0')
  # The stem joins the first layer; the head is index U = 3.
  assert layout.owner == {
    'stem': 0,
    'layer1_0': 0,
    'layer2_0': 1,
    'layer3_0': 2,
    'head': 3,
  }
  assert layout.width == 4
  resnet = fedepth.layout_of(model_lib.get('resnet18', 10, (8, 8, 3)))
  assert resnet.layers == tuple(
    f'layer{i}_{j}' for i in (1, 2, 3, 4) for j in (0, 1)
  )
  assert resnet.owner['conv1'] == resnet.owner['bn1'] == 0
  assert resnet.owner['layer3_1'] == 5 and resnet.owner['linear'] == 8
  assert resnet.width == 512
  # A model without residual blocks is one layer and its head.
  flat = fedepth.layout_of(helpers.linear_bn_model())
  assert flat.layers == () and flat.num_layers == 1
  assert flat.owner == {'Dense_0': 0, 'BatchNorm_0': 0, 'Dense_1': 1}


def test_adaptor_pools_and_zero_pads():
  out = jnp.arange(2 * 2 * 2 * 3, dtype=jnp.float32).reshape(2, 2, 2, 3)
  got = fedepth.adapt(out, 5)
  want = np.concatenate([out.mean(axis=(1, 2)), np.zeros((2, 2))], axis=1)
  helpers.assert_close(got, want)


def test_one_block_step_by_hand():
  # Client 0 trains block [1, 1] (layer2_0) with the head; the stem and
  # layer1_0 are frozen, layer3_0 unused. One full-batch SGD step. (Seed
  # 1: every channel of layer2_0 is active on some example.)
  model = tiny()
  data, _ = helpers.toy_data([5])
  lr = 0.5
  start = jax.jit(model.init)(jax.random.key(1))  # op by op: 140 compiles
  algorithm = fedepth.fedepth(_sgd(model, lr), 1, [[(1, 1)]])
  out, _ = jax.jit(algorithm.client_update)(
    start, (), (), data, jnp.int32(0), jax.random.key(1)
  )
  p = start['params']
  row = data.row(0)[:5]
  x = client_data_lib.normalize(data.x[row], data.scale, data.shift)
  x = x.reshape(5, -1)
  y = data.y[row]

  def layer2(w2, b2):
    h = x @ p['stem']['kernel'] + p['stem']['bias']
    dense1 = p['layer1_0']['dense']
    h = jax.nn.relu(h @ dense1['kernel'] + dense1['bias'])
    return jax.nn.relu(h @ w2 + b2)  # 3 channels

  def loss(w2, b2, wh, bh):
    h = layer2(w2, b2)
    feats = jnp.concatenate([h, jnp.zeros((5, 1))], axis=1)  # padded to 4
    logits = feats @ wh + bh
    logp = logits - jax.scipy.special.logsumexp(logits, axis=1, keepdims=True)
    return -jnp.mean(logp[jnp.arange(5), y])

  args = (
    p['layer2_0']['dense']['kernel'],
    p['layer2_0']['dense']['bias'],
    p['head']['kernel'],
    p['head']['bias'],
  )
  assert jnp.all(jnp.any(jax.jit(layer2)(*args[:2]) > 0, axis=0))
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
  want = [a - lr * g for a, g in zip(args, grads)]
  q = out.variables['params']
  got = [
    q['layer2_0']['dense']['kernel'],
    q['layer2_0']['dense']['bias'],
    q['head']['kernel'],
    q['head']['bias'],
  ]
  for g, w in zip(got, want):
    helpers.assert_close(g, w, rtol=1e-5, atol=1e-6)
  # The padded channel's head row sees zero input: untouched.
  np.testing.assert_array_equal(q['head']['kernel'][3], p['head']['kernel'][3])
  # Frozen and unused layers exactly as received.
  for name in ('stem', 'layer1_0', 'layer3_0'):
    chex.assert_trees_all_equal(q[name], p[name])
  helpers.assert_close(out.loss, jax.jit(loss)(*args), rtol=1e-5)
  assert int(out.num_steps) == 1 and int(out.num_examples) == 5


@pytest.mark.slow
def test_frozen_layers_and_statistics_stay_put():
  # BatchNorm model. Client 0's only block is [1, 1]: the stem and layers
  # 0 and 2 (parameters and running statistics) stay as received, though
  # the whole network runs in training mode. Client 1 trains the head
  # alone: every layer stays. The optimizer decays every weight, so only
  # restoring the leaves outside the block keeps them put.
  model = tiny(bn=True)
  data, _ = helpers.toy_data([7, 5])
  start = model.init(jax.random.key(0))
  decayed = optax.chain(
    optax.add_decayed_weights(0.1), optax.sgd(0.1, momentum=0.9)
  )
  local = client.LocalTraining(model, decayed, 2, 4)
  algorithm = fedepth.fedepth(local, 1, [[(1, 1)], [(3, 2)]])
  update = jax.jit(algorithm.client_update)

  def moved(a, b):
    return all(
      float(jnp.abs(x - y).sum()) > 0
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )

  out, _ = update(start, (), (), data, jnp.int32(0), jax.random.key(2))
  v = out.variables
  for col in ('params', 'batch_stats'):
    for name in ('layer1_0', 'layer3_0'):
      chex.assert_trees_all_equal(v[col][name], start[col][name])
    assert moved(v[col]['layer2_0'], start[col]['layer2_0'])
  chex.assert_trees_all_equal(v['params']['stem'], start['params']['stem'])
  assert moved(v['params']['head'], start['params']['head'])
  out, _ = update(start, (), (), data, jnp.int32(1), jax.random.key(2))
  v = out.variables
  for col in ('params', 'batch_stats'):
    for name in ('layer1_0', 'layer2_0', 'layer3_0'):
      chex.assert_trees_all_equal(v[col][name], start[col][name])
  chex.assert_trees_all_equal(v['params']['stem'], start['params']['stem'])
  assert moved(v['params']['head'], start['params']['head'])


@pytest.mark.slow
def test_blocks_run_in_sequence():
  # A client with blocks [0, 0], [1, 2] ends where block [0, 0] (with the
  # client's key) followed by block [1, 2] (with fold_in(key, 1)) ends,
  # each run as a one-block client; while [1, 2] trains, layer 0 stays
  # exactly where [0, 0] left it.
  model = tiny(bn=True)
  data, _ = helpers.toy_data([6])
  local = contract.local_training(model)
  start = model.init(jax.random.key(0))
  key = jax.random.key(3)
  two = fedepth.fedepth(local, 1, [[(0, 0), (1, 2)]])
  first = fedepth.fedepth(local, 1, [[(0, 0)]])
  second = fedepth.fedepth(local, 1, [[(1, 2)]])
  jit = helpers.program_jit
  out, _ = jit(two.client_update)(start, (), (), data, jnp.int32(0), key)
  mid, _ = jit(first.client_update)(start, (), (), data, jnp.int32(0), key)
  end, _ = jit(second.client_update)(
    mid.variables, (), (), data, jnp.int32(0), jax.random.fold_in(key, 1)
  )
  helpers.assert_close(out.variables, end.variables, rtol=1e-6, atol=1e-7)
  for col in ('params', 'batch_stats'):
    chex.assert_trees_all_equal(
      out.variables[col]['layer1_0'], mid.variables[col]['layer1_0']
    )
  assert int(out.num_steps) == int(mid.num_steps) + int(end.num_steps)
  helpers.assert_close(out.loss, (mid.loss + end.loss) / 2, rtol=1e-6)


def test_masked_aggregation_by_hand():
  # Layers: 'a' is layer 0, 'b' layer 1, 'h' the head (index 2).
  glob = {
    'params': {
      'a': jnp.array([0.0]),
      'b': jnp.array([9.0]),
      'h': jnp.array([5.0]),
    }
  }
  leaves = {'params': {'a': 0, 'b': 1, 'h': 2}}
  clients = jax.tree.map(
    lambda g: jnp.stack([g + 1, g + 2, g + 4]).astype(jnp.float32), glob
  )
  weights = jnp.array([1, 3, 4])
  # Client 0 trained layers 0 and 1, client 1 layer 1, client 2 the head
  # alone; every client trains the head.
  trained = jnp.array(
    [[True, True, True], [False, True, True], [False, False, True]]
  )
  got = fedepth.masked_mean(clients, glob, leaves, trained, weights)
  helpers.assert_close(got['params']['a'], [1.0])  # client 0 alone
  helpers.assert_close(got['params']['b'], [9 + (1 + 6) / 4])
  helpers.assert_close(got['params']['h'], [5 + (1 + 6 + 16) / 8])
  # Clients 1 and 2 alone: nobody trained layer 0, which keeps its global
  # value; the plain mean.
  rest = jax.tree.map(lambda x: x[1:], clients)
  got = fedepth.masked_mean(rest, glob, leaves, trained[1:], None)
  helpers.assert_close(got['params']['a'], [0.0])
  helpers.assert_close(got['params']['b'], [11.0])
  helpers.assert_close(got['params']['h'], [8.0])


def test_aggregate_keeps_untrained_layers_and_counts_bytes():
  model = tiny()
  start = model.init(jax.random.key(0))
  blocks = [[(0, 0)], [(2, 2)], [(3, 2)]]  # layer 1: nobody
  algorithm = fedepth.fedepth(_sgd(model), 3, blocks, weighted=False)
  state = algorithm.init(start)
  ids = jnp.arange(3, dtype=jnp.int32)
  outputs = contract.fake_outputs(
    jax.tree.map(lambda x: jnp.stack([x] * 3), start), jax.random.key(0)
  )
  new, metrics = jax.jit(algorithm.aggregate)(
    state, outputs, ids, jnp.int32(0), jax.random.key(1)
  )
  p, up = new.params['params'], outputs.variables['params']
  chex.assert_trees_all_equal(p['layer2_0'], start['params']['layer2_0'])
  helpers.assert_close(p['stem'], jax.tree.map(lambda x: x[0], up['stem']))
  helpers.assert_close(
    p['layer3_0'], jax.tree.map(lambda x: x[1], up['layer3_0'])
  )
  helpers.assert_close(
    p['head'], jax.tree.map(lambda x: x.mean(0), up['head']), rtol=1e-6
  )
  size = {n: tree.nbytes(start['params'][n]) for n in start['params']}
  down = 3 * sum(size.values())
  up_bytes = (
    size['stem'] + size['layer1_0'] + size['layer3_0'] + 3 * size['head']
  )
  helpers.assert_close(metrics['bytes_communicated'], down + up_bytes)
  helpers.assert_close(metrics['mean_blocks'], 1.0)


@pytest.mark.slow
def test_whole_model_blocks_are_fedavg():
  # Every client one block holding the whole model (layers_per_block >=
  # U): FedAvg, through the engine. Local training is the same bit for
  # bit (the selects on the block range pass values through, the head
  # reads the network's own representation, the first block uses the
  # client's key); the masked mean with every client holding every leaf is
  # FedAvg's Σ n·w / Σ n, which XLA may add up in another order than
  # FedAvg's own sum (1 ULP after round 1; round 2's training carries it
  # to ~5e-6 relative).
  model = tiny(bn=True)
  data, _ = helpers.toy_data([5, 9, 3, 12, 7, 4])
  local = contract.local_training(model)
  algorithms = (
    fedepth.fedepth(local, 4, [fedepth.fixed_blocks(3, 3)] * 6),
    fedavg.fedavg(local, 4),
  )
  states = contract.server_params_after(algorithms, model, data)
  helpers.assert_close(states[0], states[1], rtol=5e-5, atol=1e-6)


def _table(needs):
  return lambda a, b: needs[a, b]


def test_decompose_rules_on_a_table():
  # needs[a, b]: block [a, b] of 4 layers; needs[4, 3]: the head alone.
  needs = {}
  for a in range(4):
    for b in range(a, 4):
      needs[a, b] = 10 * (b - a + 1) + 100 * (a == 0)
  needs[4, 3] = 5
  need = _table(needs)
  assert fedepth.decompose(200, 4, need) == [(0, 3)]  # 140 fits: whole
  # 120: layer 0 fits alone (110), two layers from 0 do not (120 <= 120
  # does: [0, 1]), then [2, 3] (20).
  assert fedepth.decompose(120, 4, need) == [(0, 1), (2, 3)]
  assert fedepth.decompose(115, 4, need) == [(0, 0), (1, 3)]
  # Layer 0 never fits: skipped; the rest in one block of 30.
  assert fedepth.decompose(30, 4, need) == [(1, 3)]
  assert fedepth.decompose(10, 4, need) == [(1, 1), (2, 2), (3, 3)]
  # Nothing fits: the head alone (even over budget).
  assert fedepth.decompose(5, 4, need) == [(4, 3)]
  assert fedepth.decompose(1, 4, need) == [(4, 3)]
  assert fedepth.fixed_blocks(8, 3) == [(0, 2), (3, 5), (6, 7)]
  assert fedepth.fixed_blocks(3, 5) == [(0, 2)]
  table = fedepth.block_table([[(0, 1), (2, 3)], [(4, 3)], [(1, 1)]], 4)
  np.testing.assert_array_equal(table.count, [2, 1, 1])
  np.testing.assert_array_equal(table.first, [[0, 2], [4, 0], [1, 0]])
  np.testing.assert_array_equal(table.last, [[1, 3], [3, -1], [1, -1]])
  np.testing.assert_array_equal(
    table.trained,
    [[1, 1, 1, 1, 1], [0, 0, 0, 0, 1], [0, 1, 0, 0, 1]],
  )
  with pytest.raises(ValueError, match='bad blocks'):
    fedepth.block_table([[(1, 1), (0, 0)]], 4)


@pytest.mark.slow
def test_budgets_give_the_documented_blocks_on_measured_memory():
  model = tiny(bn=True)
  layout = fedepth.layout_of(model)
  need = fedepth.block_memory(model, layout, 4, None)
  whole, head = need(0, 2), need(3, 2)
  # Freezing the prefix saves memory; a longer block needs more.
  assert 0 < head < need(2, 2) < need(1, 2) < whole
  assert need(0, 0) < need(0, 1) < whole
  gb = 1 << 30
  cases = [whole, need(1, 2), need(2, 2), head, head // 2]
  hp = fedepth.Hparams(
    budgets_gb=','.join(repr(c / gb) for c in cases),
    budget_fractions=','.join(['0.2'] * 5),
    reference_size=0,
    reference_batch=4,
  )
  blocks = fedepth.blocks_for(model, 10, hp)
  assigned = np.round(
    fedepth.budgets_lib.client_budgets(
      10, 0, [c / gb for c in cases], [0.2] * 5
    )
  ).astype(np.int64)
  for budget, got in zip(assigned, blocks):
    assert got == fedepth.decompose(int(budget), 3, need)
    if budget >= whole:
      assert got == [(0, 2)]
    elif budget < head:
      assert got == [(3, 2)]
    else:
      for a, b in got:  # every block fits and is as long as can be
        assert need(a, b) <= budget
        assert b == 2 or need(a, b + 1) > budget
  assert sorted(map(len, blocks))[0] == 1 and [(0, 2)] in blocks
  assert [(3, 2)] in blocks


@pytest.mark.slow
def test_contract():
  blocks = [[(0, 2)], [(0, 0), (1, 2)], [(1, 1)], [(3, 2)], [(0, 0)], [(2, 2)]]
  history = contract.check_algorithm(
    lambda local, k, n: fedepth.fedepth(local, k, blocks), model=tiny(True)
  )
  counts = np.array([1, 2, 1, 1, 1, 1], np.float32)  # blocks per client
  for m in history:  # of the sampled clients
    assert m['mean_blocks'] == np.mean(counts[m['client_ids']])


def test_bad_hparams_name_their_flag():
  for changes, field in (
    (dict(layers_per_block=-1), 'layers_per_block'),
    (dict(budgets_gb='1,0'), 'budgets_gb'),
    (dict(budgets_gb='a'), 'budgets_gb'),
    (dict(budget_fractions='0.5,0.5'), 'budget_fractions'),
    (dict(reference_size=-1), 'reference_size'),
    (dict(reference_batch=0), 'reference_batch'),
  ):
    with pytest.raises(errors.ArgumentError, match=f'^{field} must'):
      fedepth.Hparams(**changes).validate()
    try:
      fedepth.Hparams(**changes).validate()
    except errors.ArgumentError as e:
      error = checks.as_config_error('fedepth', e)
    assert isinstance(error, errors.ConfigError)
    assert str(error).startswith(f'`fedepth_{field}` must')
