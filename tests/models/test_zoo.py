"""ResNet-20/18, VGG-16, the char LSTM and logistic regression: counts,
BatchNorm state, dropout, registry errors."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.core import errors
from fedjax_mr.core import tree
from fedjax_mr.models import layers
from fedjax_mr.models import lstm
from fedjax_mr.models import model as model_lib
from fedjax_mr.models import resnet
from tests import helpers


def _abstract(m):
  return jax.eval_shape(m.init, jax.random.key(0))


@functools.cache
def _initialized(name, classes, shape):
  """`(model, variables)`, built once for the module: initializing the
  large zoo models takes seconds at -O0 (VGG-16 draws 33 M normals), and
  several tests read the same ones."""
  m = model_lib.get(name, classes, shape)
  return m, m.init(jax.random.key(0))


# Parameter counts as PyTorch counts them (BN scale and bias are parameters;
# running statistics are buffers, here `batch_stats`).
@pytest.mark.parametrize(
  'name,classes,shape,count,stats',
  [
    ('resnet20', 10, (32, 32, 3), 218_970, 2_208),
    ('resnet20', 62, (28, 28, 1), 232_046, 2_208),
    ('resnet18', 10, (32, 32, 3), 11_173_962, 9_600),
    ('resnet18_w16', 10, (28, 28, 1), 701_178, 2_400),
    ('vgg16', 10, (32, 32, 3), 33_646_666, 8_448),
    ('vgg16', 62, (28, 28, 1), 33_858_558, 8_448),
    ('char_lstm', 80, (80,), 819_920, 0),
    ('logistic', 10, (60,), 610, 0),
  ],
)
def test_parameter_counts(name, classes, shape, count, stats):
  v = _abstract(model_lib.get(name, classes, shape))
  assert tree.num_parameters(v['params']) == count
  assert tree.num_parameters(v.get('batch_stats', {})) == stats
  logits = jax.eval_shape(
    model_lib.get(name, classes, shape).apply_eval,
    v,
    jax.ShapeDtypeStruct((2, *shape), jnp.float32),
  )
  assert logits.shape == (2, classes)


def test_vgg16_parameter_count_by_hand():
  # What experiments/torch_reference.VGG16 (the benchmark's PyTorch VGG-16)
  # must count too, layer by layer for 32×32×3 and C = 10. A 3×3
  # convolution with bias: (9 × in + 1) × out; its BatchNorm: scale and
  # bias, 2 × out (running statistics are not parameters).
  def conv_bn(c_in, c_out):
    return (9 * c_in + 1) * c_out + 2 * c_out

  convs = [
    conv_bn(3, 64),  # 1,920
    conv_bn(64, 64),  # 37,056
    conv_bn(64, 128),  # 74,112
    conv_bn(128, 128),  # 147,840
    conv_bn(128, 256),  # 295,680
    conv_bn(256, 256),  # 590,592
    conv_bn(256, 256),  # 590,592
    conv_bn(256, 512),  # 1,181,184
    *[conv_bn(512, 512)] * 5,  # 2,360,832 each
  ]
  assert convs[:5] == [1_920, 37_056, 74_112, 147_840, 295_680]
  assert convs[7:] == [1_181_184, *[2_360_832] * 5]
  dense = [
    512 * 4096 + 4096,  # fc0: the 512 channels of the 1×1 map, 2,101,248
    4096 * 4096 + 4096,  # fc1: 16,781,312
    4096 * 10 + 10,  # fc2: 40,970
  ]
  assert dense == [2_101_248, 16_781_312, 40_970]
  assert sum(convs) == 14_723_136 and sum(convs) + sum(dense) == 33_646_666
  v = _abstract(model_lib.get('vgg16', 10, (32, 32, 3)))
  assert tree.num_parameters(v['params']) == sum(convs) + sum(dense)
  # Layer by layer too: the convolutions with their BatchNorms, the dense.
  for i, want in enumerate(convs):
    got = tree.num_parameters(v['params'][f'conv{i}']) + tree.num_parameters(
      v['params'][f'bn{i}']
    )
    assert got == want, i
  for j, want in enumerate(dense):
    assert tree.num_parameters(v['params'][f'fc{j}']) == want, j


def test_resnet20_leaves_out_the_unused_final_bn():
  # The reference builds BatchNorm(256) after the last stage and never calls
  # it: PyTorch counts 219,482 = 218,970 + 512 (its scale and bias).
  m = model_lib.get('resnet20', 10, (32, 32, 3))
  with_bn = m._replace(module=resnet.ResNet20(10, final_bn_relu=True))
  v, v_bn = _abstract(m), _abstract(with_bn)
  assert tree.num_parameters(v_bn['params']) == 219_482
  assert (
    tree.num_parameters(v_bn['params']) - tree.num_parameters(v['params'])
    == 2 * 256
  )
  assert 'bn' not in v['params'] and 'bn' in v_bn['params']


def test_lstm_count_and_leaves_follow_pytorch():
  # Not traced: jax transformations return dicts with sorted keys.
  _, v = _initialized('char_lstm', 80, (80,))
  # Insertion order = PyTorch's state_dict order (FedMR-p's model order).
  assert list(v['params']) == ['embed', 'lstm0', 'lstm1', 'fc']
  assert list(v['params']['lstm0']) == ['w_ih', 'w_hh', 'b_ih', 'b_hh']
  shapes = jax.tree.map(lambda a: a.shape, v['params'])
  assert shapes['lstm0'] == {
    'w_ih': (8, 1024),
    'w_hh': (256, 1024),
    'b_ih': (1024,),
    'b_hh': (1024,),
  }
  # With one bias per layer (Flax's LSTMCell) it would be 2 × 1024 fewer.
  assert 819_920 - 2 * 1024 == 817_872


def test_lstm_layer_matches_the_pytorch_equations():
  layer = lstm.LSTMLayer(3)
  x = jax.random.normal(jax.random.key(0), (2, 4, 5))
  v = layer.init(jax.random.key(1), x)
  p = jax.tree.map(
    lambda a: a + 0.1 * jax.random.normal(jax.random.key(2), a.shape),
    v['params'],
  )
  got = layer.apply({'params': p}, x)
  p = jax.tree.map(np.asarray, p)
  sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
  h = c = np.zeros((2, 3))
  for t in range(4):
    g = np.asarray(x[:, t]) @ p['w_ih'] + p['b_ih'] + h @ p['w_hh'] + p['b_hh']
    i, f, gg, o = np.split(g, 4, axis=-1)
    c = sig(f) * c + sig(i) * np.tanh(gg)
    h = sig(o) * np.tanh(c)
    helpers.assert_close(got[:, t], h, rtol=1e-5, atol=1e-6)


def test_char_lstm_takes_int_tokens():
  m, v = _initialized('char_lstm', 80, (80,))
  assert m.input_dtype == jnp.int32
  x = np.random.default_rng(0).integers(0, 80, (3, 80)).astype(np.uint8)
  logits, state = m.apply_train(v, x, jax.random.key(1))
  assert logits.shape == (3, 80) and state == {}
  helpers.assert_close(m.apply_eval(v, x), logits, rtol=1e-5)


def test_every_conv_is_the_fast_one():
  seen = set()

  def spy(next_fun, args, kwargs, context):
    seen.add(type(context.module))
    return next_fun(*args, **kwargs)

  for name, shape in (
    ('resnet20', (32, 32, 3)),
    ('resnet18', (32, 32, 3)),
    ('vgg16', (32, 32, 3)),
  ):
    with nn.intercept_methods(spy):
      _abstract(model_lib.get(name, 10, shape))
  assert layers.Conv in seen and nn.BatchNorm in seen
  assert not any(issubclass(t, nn.Conv) for t in seen)


def test_batch_norm_momentum_and_mask():
  class BN(nn.Module):
    @nn.compact
    def __call__(self, x, train, mask):
      return layers.batch_norm(x, train, mask)

  x = jax.random.normal(jax.random.key(0), (4, 2, 2, 3)) * 2 + 1
  mask = jnp.array([1.0, 1.0, 1.0, 0.0])
  v = BN().init(jax.random.key(1), x, False, None)
  _, state = BN().apply(v, x, True, mask, mutable=['batch_stats'])
  real = np.asarray(x[:3]).reshape(-1, 3)
  stats = state['batch_stats']['BatchNorm_0']
  # PyTorch's momentum 0.1: running = 0.9 · running + 0.1 · batch.
  helpers.assert_close(stats['mean'], 0.1 * real.mean(0), rtol=1e-5)
  helpers.assert_close(stats['var'], 0.9 + 0.1 * real.var(0), rtol=1e-5)


# ResNet-18 at width 16: the same module, basic blocks and BatchNorms
# (after every convolution and in the projection shortcuts) as at full
# width, with 1/16 of its parameters to draw; the split test below
# initializes the same model at the same shape.
@pytest.mark.parametrize(
  'name,shape',
  [
    ('resnet20', (8, 8, 3)),
    ('resnet18_w16', (8, 8, 1)),
    ('vgg16', (8, 8, 3)),
  ],
)
def test_padded_rows_change_neither_statistics_nor_real_logits(name, shape):
  m, v = _initialized(name, 10, shape)
  x = jax.random.normal(jax.random.key(1), (3, *shape))
  junk = x.at[2].set(100.0)
  mask = jnp.array([1.0, 1.0, 0.0])
  key = jax.random.key(2)
  apply = jax.jit(m.apply_train)
  logits_a, state_a = apply(v, x, key, mask)
  logits_b, state_b = apply(v, junk, key, mask)
  helpers.assert_close(logits_a[:2], logits_b[:2], rtol=1e-4, atol=1e-4)
  jax.tree.map(
    lambda a, b: helpers.assert_close(a, b, rtol=1e-5, atol=1e-6),
    state_a,
    state_b,
  )
  # The statistics did move (0.1 of the batch statistics).
  moved = jax.tree.map(
    lambda a, b: float(jnp.max(jnp.abs(a - b))),
    state_a['batch_stats'],
    v['batch_stats'],
  )
  assert min(jax.tree.leaves(moved)) > 0
  # Evaluation uses the running statistics: rows are independent.
  evaluate = jax.jit(m.apply_eval)
  out = evaluate({**v, **state_a}, junk)
  helpers.assert_close(
    out[:2], evaluate({**v, **state_a}, x)[:2], rtol=1e-5, atol=1e-5
  )


def test_vgg_dropout_only_in_training():
  m, v = _initialized('vgg16', 10, (8, 8, 3))
  x = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))
  a, _ = m.apply_train(v, x, jax.random.key(1))
  b, _ = m.apply_train(v, x, jax.random.key(1))
  c, _ = m.apply_train(v, x, jax.random.key(2))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)
  np.testing.assert_array_equal(m.apply_eval(v, x), m.apply_eval(v, x))


@pytest.mark.parametrize(
  'name,shape,dataset,match',
  [
    ('char_lstm', (32, 32, 3), 'cifar10', 'takes token sequences.*cifar10'),
    ('resnet20', (80,), 'shakespeare', 'takes images.*shakespeare'),
    ('vgg16', (80,), 'shakespeare', 'takes images'),
    ('cnn_cifar', (80,), 'shakespeare', 'takes images'),
    ('resnet18', (4, 4, 3), '', r'H, W ≥ 8'),
    ('logistic', (28, 28, 1), 'fashion_mnist', 'takes vectors.*fashion_'),
  ],
)
def test_incompatible_pairs_name_model_and_dataset(name, shape, dataset, match):
  with pytest.raises(errors.ConfigError, match=match) as e:
    model_lib.get(name, 10, shape, dataset=dataset)
  assert f'`model={name}`' in str(e.value) and '`dataset' in str(e.value)


def test_logistic_regression_by_hand():
  m = model_lib.get('logistic', 3, (4,))
  assert m.input_dtype == jnp.float32
  v = m.init(jax.random.key(0))
  w, b = v['params']['Dense_0']['kernel'], v['params']['Dense_0']['bias']
  x = jax.random.normal(jax.random.key(1), (5, 4))
  helpers.assert_close(m.apply_eval(v, x), x @ w + b, rtol=1e-6)
  np.testing.assert_array_equal(m.apply_features(v, x), x)


def test_registry_lists_the_zoo():
  assert {'resnet20', 'resnet18', 'vgg16', 'char_lstm', 'logistic'} <= set(
    model_lib.NAMES
  )
  with pytest.raises(errors.ConfigError, match='^`model`: unknown.*resnet20'):
    model_lib.get('resnet1000', 10, (32, 32, 3))


@pytest.mark.parametrize(
  'name,classes,shape,dim,head',
  [
    ('cnn_mnist', 10, (28, 28, 1), 50, 'Dense_1'),
    ('cnn_cifar', 10, (32, 32, 3), 84, 'Dense_2'),
    ('cnn_femnist', 62, (28, 28, 1), 256, 'Dense_1'),
    ('cnn_fedavg', 10, (28, 28, 1), 512, 'Dense_1'),
    ('resnet20', 10, (8, 8, 3), 256, 'linear'),
    ('resnet18', 10, (8, 8, 3), 512, 'linear'),
    ('resnet18_w16', 10, (8, 8, 1), 128, 'linear'),
    ('vgg16', 10, (8, 8, 3), 4096, 'fc2'),
    ('char_lstm', 12, (5,), 256, 'fc'),
    ('logistic', 10, (60,), 60, 'Dense_0'),
  ],
)
def test_split_at_the_head_is_the_whole_network(
  name, classes, shape, dim, head
):
  # The representation (input of the last Dense) and the head alone give
  # apply_train's logits and state; the parameter names stay those of the
  # whole network (checkpoints and FedMR's layer order do not change).
  m = model_lib.get(name, classes, shape)
  assert m.feature_dim() == dim
  assert _abstract(m)['params'][head]['kernel'].shape == (dim, classes)
  if name in ('resnet18', 'vgg16'):
    return  # large: the same split as resnet20 / the CNNs, shapes above
  m, v = _initialized(name, classes, shape)
  if name == 'char_lstm':
    x = jax.random.randint(jax.random.key(1), (3, *shape), 0, classes)
  else:
    x = jax.random.uniform(jax.random.key(1), (3, *shape))
  mask = jnp.array([1.0, 1.0, 0.0])
  logits, state = m.apply_train(v, x, jax.random.key(2), mask)
  split, feats, split_state = m.apply_train_features(
    v, x, jax.random.key(2), mask
  )
  assert feats.shape == (3, dim)
  np.testing.assert_array_equal(split, logits)
  jax.tree.map(np.testing.assert_array_equal, split_state, state)
  helpers.assert_close(m.apply_head(v, feats), logits, rtol=1e-6)
