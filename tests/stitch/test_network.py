"""Stitched networks: building, folding, label maps, head and kNN probes."""

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.stitch import network
from fedjax_mr.stitch import projection
from tests import helpers
from tests.stitch import common


def _identity(prev, block):
  c = block.in_spec[-1]
  return projection.make_stitch(np.eye(c), prev.out_spec, block.in_spec)


def _own_network(name='cnn_mnist'):
  """A model's own chain joined by identity stitches."""
  chain = common.chain(name)
  net = network.start(chain[0])
  for prev, block in zip(chain[:-1], chain[1:]):
    net = network.extend(net, _identity(prev, block), block)
  return net


def _mixed_network(rng):
  """cnn_mnist[0] → cnn_femnist[1] → cnn_cifar[2] with random stitches."""
  a = common.chain('cnn_mnist')[0]  # → (12, 12, 20)
  b = common.chain('cnn_femnist')[1]  # (12, 12, 16) → (4, 4, 32)
  c = common.chain('cnn_cifar')[2]  # (4, 4, 16) → (10,)

  def stitch(x_spec, y_spec):
    m = rng.standard_normal((x_spec[-1], y_spec[-1])) / np.sqrt(x_spec[-1])
    return projection.make_stitch(m, x_spec, y_spec)

  net = network.start(a)
  net = network.extend(net, stitch(a.out_spec, b.in_spec), b)
  return network.extend(net, stitch(b.out_spec, c.in_spec), c)


def test_start_extend_path_describe():
  chain = common.chain('cnn_mnist')
  other = common.chain('cnn_femnist')
  net = network.start(chain[0])
  assert net.path == (('cnn_mnist', 0),)
  assert net.depth == 1 and not net.finished
  assert net.stitches == (None,)
  assert net.out_spec == (12, 12, 20)
  s = projection.make_stitch(np.ones((20, 16)), (12, 12, 20), (12, 12, 16))
  net = network.extend(net, s, other[1])
  assert net.path == (('cnn_mnist', 0), ('cnn_femnist', 1))
  assert net.stitches[1] is s and net.depth == 2 and not net.finished
  assert net.describe() == 'cnn_mnist[0] → cnn_femnist[1]'
  s2 = projection.make_stitch(np.ones((32, 50)), (4, 4, 32), (4, 4, 50))
  done = network.extend(net, s2, chain[2])
  assert done.finished and done.out_spec == (10,)
  assert done.describe() == 'cnn_mnist[0] → cnn_femnist[1] → cnn_mnist[2]'
  with pytest.raises(ValueError, match='finished'):
    network.extend(done, s2, chain[2])
  with pytest.raises(ValueError, match='not a start block'):
    network.start(chain[1])


def test_own_chain_with_identity_stitches_is_the_model():
  net = _own_network()
  assert all(s.size is None and not s.pool for s in net.stitches[1:])
  x = common.inputs(common.IMAGE, n=4)
  v = common.variables('cnn_mnist', 10, common.IMAGE)
  ref = common.apply_eval('cnn_mnist', 10, common.IMAGE)(v, x)
  helpers.assert_close(network.apply(net, x), ref, rtol=1e-5, atol=1e-5)


def test_apply_runs_stitches_between_blocks():
  rng = np.random.default_rng(0)
  net = _mixed_network(rng)
  x = common.inputs(common.IMAGE, n=2)
  h = net.blocks[0].apply(x)
  h = net.blocks[1].apply(projection.apply(net.stitches[1], h))
  h = net.blocks[2].apply(projection.apply(net.stitches[2], h))
  helpers.assert_close(network.apply(net, x), h, rtol=1e-6, atol=1e-6)
  assert network.apply(net, x).shape == (2, 10)


def test_fold_equals_unfolded():
  net = _mixed_network(np.random.default_rng(1))
  folded = network.fold(net)
  assert folded.path == net.path
  assert folded.stitches == (None, None, None)  # same sizes: nothing left
  assert [b.in_spec for b in folded.blocks] == [
    (28, 28, 1),
    (12, 12, 20),
    (4, 4, 32),
  ]
  x = common.inputs(common.IMAGE, n=3)
  ref = np.asarray(network.apply(net, x))
  out = np.asarray(network.apply(folded, x))
  helpers.assert_close(out, ref, atol=1e-5 * np.abs(ref).max())


def test_fold_keeps_resizes_and_bias_stitches():
  rng = np.random.default_rng(2)
  a = common.chain('cnn_fedavg')[0]  # → (14, 14, 32)
  b = common.chain('cnn_mnist')[1]  # (12, 12, 20) → (4, 4, 50)
  c = common.chain('cnn_fedavg')[2]  # (7, 7, 64) → (10,)
  m1 = rng.standard_normal((32, 20)) / 6
  m2 = rng.standard_normal((51, 64)) / 7
  net = network.start(a)
  net = network.extend(
    net, projection.make_stitch(m1, a.out_spec, b.in_spec), b
  )
  with_bias = projection.make_stitch(m2, b.out_spec, c.in_spec, bias=True)
  net = network.extend(net, with_bias, c)
  folded = network.fold(net)
  assert folded.stitches[1].matrix is None
  assert folded.stitches[1].size == (12, 12)
  assert folded.stitches[2] is with_bias and folded.blocks[2] is c
  x = common.inputs(common.IMAGE, n=2)
  ref = np.asarray(network.apply(net, x))
  out = np.asarray(network.apply(folded, x))
  helpers.assert_close(out, ref, atol=1e-5 * np.abs(ref).max())


def test_map_labels():
  logits = np.array([[1.0, 5.0, 2.0, 0.0], [3.0, 1.0, 4.0, 2.0]])
  label_map = [[0, 1], [2, 3]]
  np.testing.assert_array_equal(
    network.map_labels(logits, label_map, 'max'), [[5, 2], [3, 4]]
  )
  np.testing.assert_array_equal(
    network.map_labels(logits, label_map, 'sum'), [[6, 2], [4, 6]]
  )
  # Overlapping sets and a single source each.
  np.testing.assert_array_equal(
    network.map_labels(logits, [[3], [0, 2], [1]], 'max'),
    [[0, 2, 5], [2, 4, 1]],
  )
  np.testing.assert_array_equal(network.map_labels(logits, None), logits)
  with pytest.raises(ValueError, match='no source'):
    network.map_labels(logits, [[0], []])
  with pytest.raises(ValueError, match='reduce'):
    network.map_labels(logits, label_map, 'mean')


def test_knn_predict_by_hand():
  train = np.array([[0.0], [1.0], [10.0], [11.0], [12.0]])
  labels = np.array([0, 0, 1, 1, 1])
  x = np.array([[0.5], [11.0], [6.0]])
  np.testing.assert_array_equal(
    network.knn_predict(train, labels, x, k=1), [0, 1, 1]
  )
  np.testing.assert_array_equal(
    network.knn_predict(train, labels, x, k=3), [0, 1, 1]
  )
  # k above the reference size: every point votes (3 of class 1).
  np.testing.assert_array_equal(
    network.knn_predict(train, labels, x, k=50), [1, 1, 1]
  )
  # Chunking does not change the answer.
  np.testing.assert_array_equal(
    network.knn_predict(train, labels, x, k=3, chunk=1), [0, 1, 1]
  )


@pytest.mark.parametrize(
  'order,k,expected',
  [
    # Labels of the neighbours from nearest to farthest.
    ([1, 0], 2, 1),
    ([0, 1], 2, 0),
    ([1, 0, 0, 1], 4, 1),  # 2–2: the nearest (class 1) wins
    ([0, 1, 1, 0], 4, 0),
    ([2, 1, 0, 1, 2], 5, 2),  # 2–2 between classes 1 and 2; 2 is nearest
    ([1, 0, 0, 1, 2], 5, 1),
    ([1, 0, 0, 0, 1], 5, 0),  # a majority beats the nearest
  ],
)
def test_knn_ties_go_to_the_nearest(order, k, expected):
  train = np.arange(1.0, len(order) + 1)[:, None]  # distances 1, 2, 3…
  pred = network.knn_predict(train, np.array(order), np.zeros((1, 1)), k=k)
  assert pred.tolist() == [expected]


def test_head_accuracy_of_own_chain_equals_the_model():
  net = _own_network()
  rng = np.random.default_rng(3)
  x = np.asarray(common.inputs(common.IMAGE, n=7, seed=4))
  v = common.variables('cnn_mnist', 10, common.IMAGE)
  pred = np.asarray(
    common.apply_eval('cnn_mnist', 10, common.IMAGE)(v, x)
  ).argmax(1)
  y = pred.copy()
  y[:3] = (pred[:3] + 1 + rng.integers(0, 9, 3)) % 10  # 3 of 7 wrong
  assert network.head_accuracy(net, x, y) == pytest.approx(4 / 7)
  assert network.head_accuracy(net, x, y, batch_size=3) == pytest.approx(4 / 7)
  # uint8 images, scaled as the dataset's loader would.
  x8 = np.round(x * 255).astype(np.uint8)
  pred8 = np.asarray(
    common.apply_eval('cnn_mnist', 10, common.IMAGE)(v, x8 / 255.0)
  ).argmax(1)
  assert network.head_accuracy(net, x8, pred8, scale=1 / 255) == 1.0
  # A label map that merges every class into one target: always right.
  assert network.head_accuracy(
    net, x, np.zeros(7, int), label_map=[list(range(10))]
  ) == pytest.approx(1.0)


def test_head_accuracy_needs_a_finished_network():
  with pytest.raises(ValueError, match='not finished'):
    network.head_accuracy(
      network.start(common.chain('cnn_mnist')[0]),
      np.zeros((1, 28, 28, 1)),
      np.zeros(1, int),
    )


def test_outputs_and_knn_accuracy():
  net = network.start(common.chain('cnn_mnist')[0])  # unfinished is fine
  x = np.asarray(common.inputs(common.IMAGE, n=5, seed=5))
  out = network.outputs(net, x, scale=2.0, shift=-1.0, batch_size=2)
  ref = network.apply(net, jnp.asarray(x) * 2.0 - 1.0)
  assert out.shape == (5, 12 * 12 * 20) and out.dtype == np.float32
  helpers.assert_close(out, np.asarray(ref).reshape(5, -1), rtol=1e-6)
  y = np.array([0, 1, 2, 1, 0])
  # Every example is its own nearest reference point.
  assert network.knn_accuracy(net, x, y, x, y, k=1) == 1.0


def test_a_chain_without_stitches_is_the_model_and_folds_to_itself():
  chain = common.chain('cnn_mnist')
  bare = network.Network(tuple(chain), (None,) * len(chain))
  x = jnp.asarray(common.inputs((28, 28, 1), n=4))
  want = np.asarray(network.apply(_own_network(), x))
  helpers.assert_close(np.asarray(network.apply(bare, x)), want, atol=1e-5)
  folded = network.fold(bare)
  assert folded.stitches == bare.stitches
  helpers.assert_close(np.asarray(network.apply(folded, x)), want, atol=1e-5)


def test_accuracies_gives_head_and_knn_from_one_call():
  net = _own_network()
  x = np.asarray(common.inputs((28, 28, 1), n=40))
  y = np.arange(40) % 10
  both = network.accuracies(net, x, y, knn_reference=(x[:20], y[:20]))
  logits = np.asarray(network.apply(net, jnp.asarray(x)))
  ref = logits[:20]
  assert both == {
    'head': float(np.mean(logits.argmax(1) == y)),
    'knn': float(np.mean(network.knn_predict(ref, y[:20], logits) == y)),
  }
  # The kNN probe fitted on the examples themselves labels its own
  # reference part right.
  assert np.all(network.knn_predict(ref, y[:20], ref, k=1) == y[:20])
  with pytest.raises(ValueError, match='not finished'):
    network.accuracies(network.start(net.blocks[0]), x, y)
