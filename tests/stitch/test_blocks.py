"""Cutting zoo models into blocks: exact chains, kinds, specs, variables."""

import jax
import jax.numpy as jnp
import pytest

from fedjax_mr.core import errors
from fedjax_mr.stitch import blocks
from fedjax_mr.stitch import units
from tests import helpers
from tests.stitch import common


@pytest.mark.parametrize('style', units.CUT_STYLES)
@pytest.mark.parametrize(
  'name,classes,shape', common.SMALL_ZOO, ids=[z[0] for z in common.SMALL_ZOO]
)
@pytest.mark.slow
def test_blocks_in_turn_equal_the_model(name, classes, shape, style):
  v = common.variables(name, classes, shape)
  x = common.inputs(shape, n=3, num_classes=classes)
  chain = common.chain(name, classes, shape, style)
  h = x
  for b in chain:
    assert h.shape[1:] == b.in_spec
    h = b.apply(h)
    assert h.shape[1:] == b.out_spec
  ref = common.apply_eval(name, classes, shape)(v, x)
  assert float(jnp.std(ref)) > 1e-3  # not a degenerate all-equal output
  helpers.assert_close(h, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('style', units.CUT_STYLES)
@pytest.mark.parametrize(
  'name,classes,shape', common.SMALL_ZOO, ids=[z[0] for z in common.SMALL_ZOO]
)
def test_kinds_specs_and_units(name, classes, shape, style):
  v = common.variables(name, classes, shape)
  chain = common.chain(name, classes, shape, style)
  assert [b.kind for b in chain] == (
    ['start'] + ['middle'] * (len(chain) - 2) + ['end']
  )
  assert [b.index for b in chain] == list(range(len(chain)))
  assert all(b.model == name and b.id == (name, b.index) for b in chain)
  assert chain[0].in_spec == shape
  assert chain[-1].out_spec == (classes,)
  for prev, nxt in zip(chain[:-1], chain[1:]):
    assert nxt.in_spec == prev.out_spec
  # The blocks partition the units, in order, and begin at the cuts.
  all_units = units.units(name, v, per_linear=style == 'per_linear')
  assert [u for b in chain for u in b.units] == [u.name for u in all_units]
  cuts = units.cut_list(name, v, style)
  assert tuple(b.units[0] for b in chain) == cuts


def test_cut_styles_by_hand():
  v = common.variables('cnn_cifar', 10, common.IMAGE)
  assert units.cut_list('cnn_cifar', v) == ('conv0', 'conv1', 'head')
  assert units.cut_list('cnn_cifar', v, 'per_linear') == (
    'conv0',
    'conv1',
    'fc0',
    'fc1',
    'fc2',
  )
  v = common.variables('resnet20', 10, common.IMAGE)
  assert units.cut_list('resnet20', v, 'every_unit') == (
    'conv1',
    'layer1_0',
    'layer1_1',
    'layer2_0',
    'layer2_1',
    'layer3_0',
    'layer3_1',
    'head',
  )
  chain = common.chain('cnn_cifar', style='per_linear')
  assert [b.in_spec for b in chain] == [
    (28, 28, 1),
    (12, 12, 6),
    (4, 4, 16),
    (120,),
    (84,),
  ]


@pytest.mark.parametrize(
  'name,count',
  [
    ('cnn_mnist', 3),
    ('cnn_cifar', 3),
    ('cnn_fedavg', 3),
    ('cnn_femnist', 3),
    ('resnet20', 5),
    ('char_lstm', 3),
  ],
)
def test_default_block_counts(name, count):
  if name == 'char_lstm':
    chain = common.chain(name, 80, common.TOKENS)
  else:
    chain = common.chain(name)
  assert len(chain) == count


def _abstract(name, shape):
  m = common.model(name, 10, shape)
  return jax.eval_shape(m.init, jax.random.key(0))


def test_vgg16_default_cut_list_has_14_blocks():
  v = _abstract('vgg16', (32, 32, 3))
  cuts = units.cut_list('vgg16', v)
  assert cuts == tuple(f'conv{i}' for i in range(13)) + ('head',)
  assert len(units.cut_list('vgg16', v, 'per_linear')) == 16


def test_resnet18_default_has_5_blocks_shapes_only():
  # Variables as shapes only: split needs nothing but jax.eval_shape.
  v = _abstract('resnet18', (32, 32, 3))
  chain = blocks.split('r18', 'resnet18', v, (32, 32, 3))
  assert [b.kind for b in chain] == ['start'] + ['middle'] * 3 + ['end']
  assert [b.out_spec for b in chain] == [
    (32, 32, 64),
    (16, 16, 128),
    (8, 8, 256),
    (4, 4, 512),
    (10,),
  ]


def test_explicit_cuts_and_first_unit_implied():
  v = common.variables('cnn_mnist', 10, common.IMAGE)
  chain = blocks.split('m', 'cnn_mnist', v, common.IMAGE, ['conv1', 'head'])
  assert [b.units for b in chain] == [('conv0',), ('conv1',), ('head',)]
  chain = blocks.split('m', 'cnn_mnist', v, common.IMAGE, ['head'])
  assert [b.units for b in chain] == [('conv0', 'conv1'), ('head',)]
  assert [b.kind for b in chain] == ['start', 'end']
  assert [b.id for b in chain] == [('m', 0), ('m', 1)]
  x = common.inputs(common.IMAGE)
  ref = common.apply_eval('cnn_mnist', 10, common.IMAGE)(v, x)
  helpers.assert_close(
    chain[1].apply(chain[0].apply(x)), ref, rtol=1e-5, atol=1e-5
  )


@pytest.mark.parametrize(
  'cuts,pattern',
  [
    (['conv0', 'fc9'], r'`cuts`.*fc9'),
    (['head', 'conv1'], r'`cuts`.*order'),
    (['conv0'], r'`cuts`.*two blocks'),
    ('every_other', r'`cuts`.*every_other'),
  ],
)
def test_bad_cuts_raise_config_error(cuts, pattern):
  v = common.variables('cnn_mnist', 10, common.IMAGE)
  with pytest.raises(errors.ConfigError, match=pattern):
    blocks.split('m', 'cnn_mnist', v, common.IMAGE, cuts)


def test_unknown_style_in_cut_list():
  v = common.variables('cnn_mnist', 10, common.IMAGE)
  with pytest.raises(errors.ConfigError, match=r'`cuts`.*per_layer'):
    units.cut_list('cnn_mnist', v, 'per_layer')


@pytest.mark.parametrize('fn', ['split', 'cut_list', 'units'])
def test_unknown_model_names_the_argument(fn):
  v = common.variables('cnn_mnist', 10, common.IMAGE)
  call = {
    'split': lambda: blocks.split('m', 'lenet', v, common.IMAGE),
    'cut_list': lambda: units.cut_list('lenet', v),
    'units': lambda: units.units('lenet', v),
  }[fn]
  with pytest.raises(errors.ConfigError) as e:
    call()
  message = str(e.value)
  assert 'lenet' in message
  assert '`model_name`' in message, f'no argument named in {message!r}'


def _leaves_by_path(tree):
  return {
    jax.tree_util.keystr(p): leaf
    for p, leaf in jax.tree_util.tree_leaves_with_path(tree)
  }


@pytest.mark.parametrize(
  'name,classes,shape', common.SMALL_ZOO, ids=[z[0] for z in common.SMALL_ZOO]
)
def test_block_variables_are_the_used_subset(name, classes, shape):
  v = common.variables(name, classes, shape)
  chain = common.chain(name, classes, shape, 'every_unit')
  model_leaves = _leaves_by_path(v)
  seen = []
  for b in chain:
    names = {n for _, n, _ in b.steps if n}
    assert set(b.variables) <= set(v)
    for collection, tree in b.variables.items():
      assert set(tree) <= names  # only what the block's steps use
      assert set(tree) == names & set(v[collection])
    for path, leaf in _leaves_by_path(b.variables).items():
      assert leaf is model_leaves[path]  # the model's own arrays
      seen.append(path)
  # Together the blocks hold every variable exactly once.
  assert sorted(seen) == sorted(model_leaves)


def test_block_variables_by_hand():
  chain = common.chain('cnn_mnist')
  assert [sorted(b.variables['params']) for b in chain] == [
    ['Conv_0'],
    ['Conv_1'],
    ['Dense_0', 'Dense_1'],
  ]
  assert all(set(b.variables) == {'params'} for b in chain)
  chain = common.chain('resnet20')
  assert set(chain[0].variables) == {'params'}  # conv1: no BatchNorm
  assert sorted(chain[1].variables['params']) == ['layer1_0', 'layer1_1']
  assert sorted(chain[1].variables['batch_stats']) == ['layer1_0', 'layer1_1']
  assert sorted(chain[4].variables['params']) == ['linear']


def test_block_helpers():
  chain = common.chain('cnn_mnist')
  b = chain[1]
  assert b.spatial_in
  assert not common.chain('cnn_mnist', style='per_linear')[3].spatial_in
  assert b.describe() == 'cnn_mnist[1] middle conv1 (12, 12, 20)→(4, 4, 50)'
  # conv 5x5 20→50 with bias, float32.
  assert blocks.block_bytes(b) == 4 * (5 * 5 * 20 * 50 + 50)
  assert b.fold == ('conv', (('Conv_1', 'kernel'),))
  assert chain[2].fold == ('flatten', (('Dense_0', 'kernel'),))
