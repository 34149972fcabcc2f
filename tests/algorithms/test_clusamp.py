import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.cluster import hierarchy
from scipy.spatial.distance import squareform

from fedjax_mr.algorithms import clusamp
from fedjax_mr.algorithms import fedavg
from fedjax_mr.core import errors
from fedjax_mr.core import types
from fedjax_mr.training import engine
from tests import helpers
from tests.algorithms import contract

# The engine calls these inside its jitted round; compiled whole here too.
# Op by op, every operation compiles again for each new shape: the cosine
# case took 24 s so, 6 s compiled whole (the 2-core Intel).
_size_distributions = jax.jit(clusamp.size_distributions, static_argnums=1)
_distances = jax.jit(clusamp.distances, static_argnums=1)
_ward_clusters = jax.jit(clusamp.ward_clusters)
_similarity_distributions = jax.jit(
  clusamp.similarity_distributions, static_argnums=1
)


def _check_unbiased(r, p, k):
  r = np.asarray(r)
  assert r.shape == (k, len(p)) and (r >= 0).all()
  helpers.assert_close(r.sum(1), 1.0, atol=1e-5)
  helpers.assert_close(r.sum(0), k * np.asarray(p), atol=1e-5)


def test_size_distributions_by_hand():
  # Masses K p in decreasing order: 0.8, 0.6, 0.4, 0.2 (clients 2, 0, 3,
  # 1). Row 0 takes client 2 (0.8) and 0.2 of client 0; row 1 the rest of
  # client 0 (0.4), client 3 (0.4) and client 1 (0.2).
  p = jnp.array([0.3, 0.1, 0.4, 0.2])
  r = np.asarray(clusamp.size_distributions(p, 2))
  helpers.assert_close(
    r, [[0.2, 0.0, 0.8, 0.0], [0.4, 0.2, 0.0, 0.4]], atol=1e-6
  )


@pytest.mark.slow
def test_size_distributions_are_unbiased():
  rng = np.random.default_rng(0)
  for n, k in ((10, 3), (100, 10), (7, 7), (50, 1)):
    p = rng.dirichlet(np.full(n, 0.3)).astype(np.float32)
    _check_unbiased(_size_distributions(jnp.asarray(p), k), p, k)


def _scipy_cut(d, weights, k):
  """The clusters the authors' cut gives on scipy's Ward linkage of the
  condensed distances: heights replaced by the merged weight, cut at 1/K."""
  link = hierarchy.linkage(squareform(d, checks=False), 'ward')
  w = list(weights)
  for row in link:
    w.append(w[int(row[0])] + w[int(row[1])])
    row[2] = w[-1]
  labels = hierarchy.fcluster(link, 1.0 / k + 1e-6, criterion='distance')
  return link, labels


def _same_partition(a, b):
  ga = {frozenset(np.flatnonzero(a == v)) for v in np.unique(a)}
  gb = {frozenset(np.flatnonzero(b == v)) for v in np.unique(b)}
  return ga == gb


@pytest.mark.parametrize('distance', ['l2', 'l1', 'cosine'])
def test_ward_merges_and_cut_match_scipy(distance):
  rng = np.random.default_rng(1)
  n, k = 30, 5
  g = rng.normal(size=(n, 8)).astype(np.float32)
  g[:10] += 3.0  # some structure
  d = np.asarray(clusamp.distances(jnp.asarray(g), distance), np.float64)
  d = (d + d.T) / 2
  p = rng.dirichlet(np.full(n, 2.0))
  merges, labels = jax.jit(clusamp.ward_clusters)(
    jnp.asarray(d, jnp.float32), jnp.asarray(p * k, jnp.float32)
  )
  link, want = _scipy_cut(d, p, k)
  # Merge by merge, the same clusters join (scipy names a new cluster
  # n + t; ours keeps the smallest member's name).
  members = {i: {i} for i in range(n)}
  ours = {i: {i} for i in range(n)}
  for t, ((a, b), row) in enumerate(zip(np.asarray(merges), link)):
    members[n + t] = members[int(row[0])] | members[int(row[1])]
    joined = ours[int(a)] | ours.pop(int(b))
    ours[int(a)] = joined
    assert joined == members[n + t], t
  assert _same_partition(np.asarray(labels), want)
  # Every cluster of the cut holds at most 1/K of the data, or one client.
  for v in np.unique(labels):
    idx = np.flatnonzero(np.asarray(labels) == v)
    assert len(idx) == 1 or p[idx].sum() <= 1 / k + 1e-5


def test_distances_by_hand():
  g = jnp.array([[3.0, 4.0], [0.0, 2.0], [0.0, 0.0]])
  d = np.asarray(clusamp.distances(g, 'l2'))
  helpers.assert_close(d[0], [0, np.hypot(3, 2), 5], rtol=1e-6)
  helpers.assert_close(clusamp.distances(g, 'l1')[0], [0, 5, 7])
  cos = np.asarray(clusamp.distances(g, 'cosine'))
  helpers.assert_close(cos[0, 1], np.arccos(0.8), rtol=1e-5)
  # No update yet: distance 0 to everyone (the authors' convention).
  helpers.assert_close(cos[2], 0.0)


@pytest.mark.slow
def test_similarity_distributions_by_hand():
  # K = 2, p = (0.25, 0.25, 0.1, 0.1, 0.3) → masses 0.5, 0.5, 0.2, 0.2,
  # 0.6. Clusters {0, 1} (1.0), {4} (0.6), {2}, {3} (0.2 each): rows are
  # {0, 1} and {4}; the two light clients fill row 1's missing 0.4.
  p = jnp.array([0.25, 0.25, 0.1, 0.1, 0.3])
  labels = jnp.array([0, 0, 2, 3, 4])
  r = np.asarray(
    clusamp.similarity_distributions(p, 2, labels, jax.random.key(0))
  )
  helpers.assert_close(
    r, [[0.5, 0.5, 0, 0, 0], [0, 0, 0.2, 0.2, 0.6]], atol=1e-6
  )
  # A client with more than 1/K of the data fills a row and shares out the
  # rest: p = (0.7, 0.1, 0.2), K = 2 → masses 1.4, 0.2, 0.4.
  r = np.asarray(
    clusamp.similarity_distributions(
      jnp.array([0.7, 0.1, 0.2]), 2, jnp.array([0, 1, 1]), jax.random.key(0)
    )
  )
  helpers.assert_close(r, [[1, 0, 0], [0.4, 0.2, 0.4]], atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize('distance', ['cosine', 'l1', 'l2'])
def test_similarity_distributions_are_unbiased(distance):
  rng = np.random.default_rng(2)
  for n, k, zeros in ((40, 10, 0), (100, 10, 60), (12, 4, 12), (9, 9, 3)):
    p = rng.dirichlet(np.full(n, 0.5)).astype(np.float32)
    g = rng.normal(size=(n, 5)).astype(np.float32)
    g[:zeros] = 0  # clients never sampled yet
    d = _distances(jnp.asarray(g), distance)
    _, labels = _ward_clusters(d, jnp.asarray(p * k))
    r = _similarity_distributions(jnp.asarray(p), k, labels, jax.random.key(n))
    _check_unbiased(r, p, k)


def test_draw_frequencies_follow_the_distributions():
  p = jnp.array([0.3, 0.1, 0.4, 0.2])
  r = clusamp.size_distributions(p, 2)
  keys = jax.random.split(jax.random.key(0), 20_000)
  ids = np.asarray(jax.vmap(lambda key: clusamp.draw(key, r))(keys))
  # Client 0 spans both rows (0.2 + 0.4); the others sit in one row.
  helpers.assert_close(
    np.bincount(ids[:, 0], minlength=4) / 20_000, r[0], atol=0.01
  )
  helpers.assert_close(
    np.bincount(ids.ravel(), minlength=4) / 20_000, 2 * p, atol=0.015
  )


@pytest.mark.slow
@pytest.mark.parametrize('method', ['size', 'similarity'])
def test_one_client_per_cluster_samples_everyone(method):
  # N = K equal clients: each distribution is one client, so every client
  # trains every round (in some order), and the rest is FedAvg's plain
  # mean: FedAvg replaying the same draws gives the same bits.
  model = helpers.linear_bn_model()
  data, _ = helpers.toy_data([6, 6, 6, 6])
  local = contract.local_training(model)
  algorithm = clusamp.clustered_sampling(local, 4, 4, method)
  fn = jax.jit(engine.make_round_fn(algorithm, clients_per_round=4))
  state = engine.init_state(algorithm, model.init(jax.random.key(0)))
  drawn = []
  for _ in range(3):
    state, metrics = fn(state, data, jax.random.key(4))
    drawn.append(np.asarray(metrics['client_ids']))
    assert sorted(drawn[-1]) == [0, 1, 2, 3]
  table = jnp.asarray(np.stack(drawn))
  replay = fedavg.fedavg(local, 4, weighted=False)._replace(
    sampler=lambda key, r, s, d: table[r]
  )
  fn = jax.jit(engine.make_round_fn(replay, clients_per_round=4))
  ref = engine.init_state(replay, model.init(jax.random.key(0)))
  for _ in range(3):
    ref, _ = fn(ref, data, jax.random.key(4))
  helpers.tree_equal(
    jax.device_get(state.server.params), jax.device_get(ref.server.params)
  )


def test_server_keeps_each_clients_last_update():
  model = helpers.linear_model()
  local = contract.local_training(model)
  alg = clusamp.clustered_sampling(local, 3, 5)
  variables = model.init(jax.random.key(0))
  state = alg.init(variables)
  moved = jax.tree.map(lambda x: jnp.stack([x + 1, x + 2, x + 3]), variables)
  out = types.ClientOutput(
    moved, jnp.ones(3, jnp.int32), jnp.zeros(3), jnp.ones(3, jnp.int32)
  )
  ids = jnp.array([4, 1, 4], jnp.int32)  # client 4 drawn twice
  new, metrics = jax.jit(alg.aggregate)(
    state, out, ids, jnp.int32(0), jax.random.key(0)
  )
  upd = np.asarray(new.updates['Dense_0']['kernel'])
  helpers.assert_close(upd[4], 3.0)  # the later draw wins
  helpers.assert_close(upd[1], 2.0)
  helpers.assert_close(upd[[0, 2, 3]], 0.0)
  assert int(metrics['distinct_clients']) == 2
  # The global model is the plain mean of the three uploads.
  helpers.assert_close(
    new.params['params']['Dense_0']['bias'],
    variables['params']['Dense_0']['bias'] + 2,
    rtol=1e-6,
  )


def test_examples_weighting_is_refused():
  with pytest.raises(errors.ArgumentError, match='^weighted by examples'):
    clusamp.Hparams().validate(weighted=True)
  with pytest.raises(errors.ArgumentError, match='^distance must be'):
    clusamp.clustered_sampling(contract.LOCAL, 2, 4, distance='l3')
