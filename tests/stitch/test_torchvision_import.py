"""FedStitch's ImageNet pool: the safetensors reader, torchvision → Flax
weights (logits equal PyTorch's), block counts, preprocessing, the pool.

The fixtures under data/torchvision/ are small torchvision instances with
random weights and the logits PyTorch computed for them, made by
scripts/make_torchvision_fixtures.py; PyTorch is not needed here.
"""

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.core import errors
from fedjax_mr.models import imagenet
from fedjax_mr.stitch import blocks
from fedjax_mr.stitch import pool as pool_lib
from fedjax_mr.stitch import torchvision_import as tvi
from fedjax_mr.stitch import units
from tests import helpers

DATA = os.path.join(os.path.dirname(__file__), 'data', 'torchvision')
ARCHS = tvi.PAPER_POOL
# The deepest two take over 1.5 s to load and compile.
_TIMED_ARCHS = [
  pytest.param(a, marks=pytest.mark.slow)
  if a in ('densenet121', 'mobilenet_v3_large')
  else a
  for a in ARCHS
]


@functools.lru_cache(maxsize=None)
def _reference() -> dict:
  with np.load(os.path.join(DATA, 'reference.npz')) as f:
    return dict(f)


@functools.lru_cache(maxsize=None)
def _loaded(arch):
  return tvi.load_model(os.path.join(DATA, tvi.POOL_FILES[arch]))


def _input(arch):
  u = _reference()[f'{arch}_input']
  return jnp.asarray((u.astype(np.float32) - 127.5) / 64)


def _pack(header: dict, data: bytes) -> bytes:
  text = json.dumps(header).encode()
  return len(text).to_bytes(8, 'little') + text + data


def _entry(dtype, shape, begin, end):
  return {'dtype': dtype, 'shape': list(shape), 'data_offsets': [begin, end]}


# --- The reader ---------------------------------------------------------------


def test_reader_dtypes_offsets_and_metadata():
  bf16 = np.array([0x3F80, 0xC020], '<u2').tobytes()  # 1.0, -2.5
  parts = {
    'f32': ('F32', (2,), np.array([1.5, -2], '<f4').tobytes()),
    'f16': ('F16', (1, 2), np.array([0.5, 3], '<f2').tobytes()),
    'bf16': ('BF16', (2,), bf16),
    'f64': ('F64', (), np.array(1e300, '<f8').tobytes()),
    'i64': ('I64', (1,), np.array([-3], '<i8').tobytes()),
    'empty': ('U8', (0, 4), b''),
    'flags': ('BOOL', (2,), b'\x01\x00'),
  }
  # Data stored in reverse order of the header: offsets decide.
  header, data = {}, b''
  for name, (dtype, shape, raw) in reversed(parts.items()):
    header[name] = _entry(dtype, shape, len(data), len(data) + len(raw))
    data += raw
  header['__metadata__'] = {'format': 'pt'}
  tensors, meta = tvi.parse_safetensors(_pack(header, data))
  assert meta == {'format': 'pt'}
  assert list(tensors) == list(reversed(parts))
  np.testing.assert_array_equal(tensors['f32'], [1.5, -2])
  assert tensors['f16'].dtype == np.float16 and tensors['f16'].shape == (1, 2)
  np.testing.assert_array_equal(tensors['f16'], [[0.5, 3]])
  assert tensors['bf16'].dtype == np.float32
  np.testing.assert_array_equal(tensors['bf16'], [1.0, -2.5])
  assert tensors['f64'].shape == () and float(tensors['f64']) == 1e300
  assert tensors['i64'].dtype == np.int64 and tensors['i64'][0] == -3
  assert tensors['empty'].shape == (0, 4)
  np.testing.assert_array_equal(tensors['flags'], [True, False])


def _bad_headers():
  f32 = np.zeros(2, '<f4').tobytes()
  ok = _entry('F32', (2,), 0, 8)
  return [
    (b'', 'not a safetensors file: 0 bytes'),
    (b'\x05\x00\x00', 'not a safetensors file: 3 bytes'),
    ((100).to_bytes(8, 'little') + b'{}', 'truncated safetensors file'),
    ((3).to_bytes(8, 'little') + b'{x}', 'not JSON'),
    (_pack([], b''), 'bad safetensors header: holds a list, not an object'),
    (
      (100_000).to_bytes(8, 'little') + b'[' * 100_000,
      'not JSON (nested too deeply)',
    ),
    (_pack({'a': [1]}, f32), "tensor 'a' is not an object"),
    (_pack({'a': {**ok, 'dtype': 'F8_E4M3'}}, f32), "dtype 'F8_E4M3'"),
    (_pack({'a': {**ok, 'shape': [-2]}}, f32), 'shape [-2]'),
    (_pack({'a': {**ok, 'data_offsets': [8, 0]}}, f32), 'data_offsets'),
    (_pack({'a': _entry('F32', (2,), 0, 4)}, f32), 'needs 8 bytes'),
    (_pack({'a': _entry('F32', (2,), 4, 12)}, f32), 'ends at byte 12'),
    (_pack({'a': ok, '__metadata__': {'n': 1}}, f32), '__metadata__'),
  ]


@pytest.mark.parametrize('data,message', _bad_headers())
def test_reader_refuses_bad_files_in_one_line(data, message):
  with pytest.raises(errors.ConfigError) as e:
    tvi.parse_safetensors(data, 'w.safetensors')
  text = str(e.value)
  assert text.startswith('w.safetensors: ') and '\n' not in text
  assert message in text


def test_reader_memory_maps_files_and_names_them(tmp_path):
  data = _pack(
    {'w': _entry('F32', (2, 2), 0, 16)}, np.arange(4, dtype='<f4').tobytes()
  )
  path = tmp_path / 'm.safetensors'
  path.write_bytes(data)
  tensors, _ = tvi.read_safetensors(str(path))
  np.testing.assert_array_equal(tensors['w'], [[0, 1], [2, 3]])
  root = tensors['w']
  while isinstance(root.base, np.ndarray):
    root = root.base
  assert isinstance(root, np.memmap)  # a view of the mapped file, not a copy
  path.write_bytes(data[:-3])
  with pytest.raises(errors.ConfigError, match=rf'^{path}: truncated'):
    tvi.read_safetensors(str(path))
  path.write_bytes(b'')
  with pytest.raises(errors.ConfigError, match='0 bytes'):
    tvi.read_safetensors(str(path))
  with pytest.raises(errors.ConfigError, match='cannot read it'):
    tvi.read_safetensors(str(tmp_path / 'absent.safetensors'))


# --- torchvision → Flax -------------------------------------------------------


@pytest.mark.parametrize('arch', _TIMED_ARCHS)
def test_logits_equal_pytorchs(arch):
  m = _loaded(arch)
  assert m.id == arch and m.model.name == f'imagenet_{arch}'
  logits = jax.jit(m.model.apply_eval)(m.variables, _input(arch))
  want = _reference()[f'{arch}_logits']
  assert float(np.std(want)) > 0.1
  scale = float(np.abs(want).max())
  helpers.assert_close(logits, want, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize('arch', _TIMED_ARCHS)
def test_blocks_in_turn_give_pytorchs_logits(arch):
  m = _loaded(arch)
  x = _input(arch)
  chain = blocks.split(
    arch, m.model.name, m.variables, x.shape[1:], module=m.model.module
  )
  assert [b.kind for b in chain] == (
    ['start'] + ['middle'] * (len(chain) - 2) + ['end']
  )
  h = x
  for b in chain:
    assert h.shape[1:] == b.in_spec
    h = b.apply(h)
    assert h.shape[1:] == b.out_spec
  want = _reference()[f'{arch}_logits']
  scale = float(np.abs(want).max())
  helpers.assert_close(h, want, rtol=1e-5, atol=1e-6 * scale)


def _resnet_state():
  path = os.path.join(DATA, 'resnet50.safetensors')
  tensors, meta = tvi.read_safetensors(path)
  module = imagenet.module('resnet50', tvi.file_config(meta, path))
  return dict(tensors), module


def test_key_and_shape_mismatches_are_one_line_errors():
  tensors, module = _resnet_state()
  ref = tvi.convert('resnet50', tensors, module, 'r.safetensors')
  # num_batches_tracked is optional (old checkpoints lack it).
  lean = {k: v for k, v in tensors.items() if 'num_batches' not in k}
  again = tvi.convert('resnet50', lean, module)
  jax.tree.map(np.testing.assert_array_equal, again, ref)
  cases = [
    (
      {k: v for k, v in tensors.items() if k != 'layer1.0.conv2.weight'},
      '1 tensor(s) of resnet50 missing: layer1.0.conv2.weight',
    ),
    (
      {**tensors, 'layer9.weight': np.zeros(3, np.float32)},
      '1 unexpected tensor(s) for resnet50: layer9.weight',
    ),
    (
      {**tensors, 'fc.weight': np.zeros((10, 31), np.float32)},
      'fc.weight has shape (10, 31), resnet50 of this configuration '
      'expects (10, 32)',
    ),
    (
      {**tensors, 'fc.bias': np.zeros(10, np.int32)},
      'fc.bias has dtype int32, not floating point',
    ),
  ]
  for bad, message in cases:
    with pytest.raises(errors.ConfigError) as e:
      tvi.convert('resnet50', bad, module, 'r.safetensors')
    assert str(e.value).startswith(f'r.safetensors: {message}')
    assert '\n' not in str(e.value)


def test_layouts_are_mapped_as_torchvision_has_them():
  tensors, module = _resnet_state()
  v = tvi.convert('resnet50', tensors, module)
  w = tensors['layer2.0.downsample.0.weight']  # OIHW
  np.testing.assert_array_equal(
    v['params']['layer2_0']['downsample_conv']['kernel'],
    w.transpose(2, 3, 1, 0),
  )
  np.testing.assert_array_equal(
    v['batch_stats']['layer2_0']['downsample_bn']['var'],
    tensors['layer2.0.downsample.1.running_var'],
  )
  np.testing.assert_array_equal(
    v['params']['fc']['kernel'], tensors['fc.weight'].T
  )
  # AlexNet's first classifier layer: torchvision flattens (C, 6, 6).
  m = _loaded('alexnet')
  raw, _ = tvi.read_safetensors(os.path.join(DATA, 'alexnet.safetensors'))
  w = np.asarray(raw['classifier.1.weight'], np.float32)  # [32, 16·6·6]
  kernel = m.variables['params']['fc0']['kernel']  # [6·6·16, 32]
  c, h, x = 5, 2, 3
  np.testing.assert_array_equal(
    kernel[(h * 6 + x) * 16 + c], w[:, c * 36 + h * 6 + x]
  )


def test_densenet_legacy_key_names_are_accepted():
  path = os.path.join(DATA, 'densenet121.safetensors')
  tensors, meta = tvi.read_safetensors(path)
  module = imagenet.module('densenet121', tvi.file_config(meta, path))
  legacy = {
    k.replace('.norm1.', '.norm.1.').replace('.conv2.', '.conv.2.'): v
    for k, v in tensors.items()
  }
  assert legacy != tensors
  got = tvi.convert('densenet121', legacy, module)
  jax.tree.map(
    np.testing.assert_array_equal, got, _loaded('densenet121').variables
  )


def test_a_file_of_another_architecture_is_refused(tmp_path):
  src = os.path.join(DATA, 'resnet50.safetensors')
  with pytest.raises(errors.ConfigError, match='bad fedjax_mr.config'):
    tvi.load_model(src, 'densenet121')
  other = tmp_path / 'vgg19.safetensors'
  shutil.copy(src, other)
  with pytest.raises(errors.ConfigError, match='unknown architecture'):
    tvi.load_model(str(other))


# --- Full-size networks: the paper's block counts -----------------------------


_PARAMS = {  # torchvision's published parameter counts
  'alexnet': 61_100_840,
  'resnet50': 25_557_032,
  'vgg16': 138_357_544,
  'densenet121': 7_978_856,
  'mobilenet_v3_large': 5_483_032,
}


# arch: (blocks, cuts at every linear layer); the test below checks each
# on the full-size network (StitchNet cuts at every linear layer: 8, 16).
_COUNTS = {
  'resnet50': (6, 6),
  'densenet121': (6, 6),
  'mobilenet_v3_large': (20, 20),
  'alexnet': (6, 8),
  'vgg16': (14, 16),
}


@pytest.mark.parametrize(
  'arch,count,per_linear',
  [
    pytest.param(
      arch,
      *counts,
      marks=[pytest.mark.slow]
      if arch in ('densenet121', 'mobilenet_v3_large')
      else [],
    )
    for arch, counts in _COUNTS.items()
  ],
)
def test_full_size_networks_give_the_papers_block_counts(
  arch, count, per_linear
):
  model = imagenet.model(arch)
  v = jax.eval_shape(model.init, jax.random.key(0))
  assert sum(x.size for x in jax.tree.leaves(v['params'])) == _PARAMS[arch]
  chain = blocks.split(arch, model.name, v, (224, 224, 3))
  assert len(chain) == count
  cuts = units.cut_list(model.name, v)
  assert cuts == tuple(b.units[0] for b in chain)  # no cut twice
  assert [b.kind for b in chain].count('start') == 1
  assert [b.kind for b in chain].count('end') == 1
  assert chain[-1].out_spec == (1000,)
  assert len(units.cut_list(model.name, v, 'per_linear')) == per_linear


def test_the_pools_counts_add_up_to_52():
  """The paper's totals over the pool from the per-network counts the test
  above checks on each network: 52 blocks, 42 of them middle blocks."""
  assert tuple(_COUNTS) == ARCHS
  assert sum(c for c, _ in _COUNTS.values()) == 52
  assert sum(c - 2 for c, _ in _COUNTS.values()) == 42


def test_small_resnet_cuts_at_stage_inputs_with_a_downsample():
  m = _loaded('resnet50')
  assert units.cut_list(m.model.name, m.variables, module=m.model.module) == (
    'stem',
    'layer1_0',
    'layer2_0',
    'layer3_0',
    'layer4_0',
    'head',
  )
  m = _loaded('densenet121')
  assert units.cut_list(m.model.name, m.variables, module=m.model.module) == (
    'stem',
    'denseblock1_layer1',
    'transition1',
    'transition2',
    'transition3',
    'head',
  )


# --- Preprocessing and labels -------------------------------------------------


@pytest.mark.parametrize(
  'case,size,scale,shift',
  [('up', 32, 1 / 255, 0.0), ('down', 20, 1 / 127.5, -1.0)],
)
def test_preprocess_resizes_as_torchvision(case, size, scale, shift):
  u = _reference()[f'{case}_input'].astype(np.float32)
  want = _reference()[f'{case}_output']  # [0, 1] pixels, resized by torch
  p = imagenet.Preprocess(size, scale, shift)
  got = imagenet.preprocess(jnp.asarray(u * scale + shift), p)
  assert got.shape == (len(u), size, size, 3)
  want = (want - np.array(p.mean)) / np.array(p.std)  # grey → 3 channels
  helpers.assert_close(got, want, atol=2e-6)


def test_adaptive_average_pooling_by_hand():
  x = jnp.arange(5.0).reshape(1, 5, 1, 1)
  # Bins [0, 2), [1, 4), [3, 5) (floor / ceil of i·5/3).
  helpers.assert_close(
    imagenet.adaptive_avg_pool(x, (3, 1))[0, :, 0, 0], [0.5, 2.0, 3.5]
  )
  x = jnp.asarray([1.0, 3.0]).reshape(1, 2, 1, 1)  # 2 → 3: [0], [0, 1], [1]
  helpers.assert_close(
    imagenet.adaptive_avg_pool(x, (3, 1))[0, :, 0, 0], [1.0, 2.0, 3.0]
  )


def test_label_maps_are_checked():
  assert tvi.check_label_map([[3, 4], 7], 2) == [[3, 4], [7]]
  bad = [
    ([[1]], 'want a JSON list of 2 entries'),
    ({'a': 1}, 'want a JSON list of 2 entries'),
    ([[1], []], 'entry 1 must be a non-empty list'),
    ([[1], [1000]], 'class ids in [0, 1000)'),
    ([[1], [True]], 'entry 1'),
  ]
  for label_map, message in bad:
    with pytest.raises(errors.ConfigError) as e:
      tvi.check_label_map(label_map, 2)
    assert message in str(e.value) and '`label_map`' in str(e.value)
  assert tvi.check_label_map([[9]], 1, num_source=10) == [[9]]


def test_read_label_map(tmp_path):
  path = tmp_path / 'map.json'
  path.write_text('[[0, 1], [2]]')
  assert tvi.read_label_map(str(path), 2) == [[0, 1], [2]]
  path.write_text('[[0')
  with pytest.raises(errors.ConfigError, match='not JSON'):
    tvi.read_label_map(str(path), 2)


# --- The pool -----------------------------------------------------------------


def test_load_pool_takes_the_datasets_images():
  # (All five: test_stitch_program_runs_on_an_imagenet_pool.)
  ids = ['alexnet', 'vgg16']
  models = tvi.load_pool(
    DATA,
    input_shape=(28, 28, 1),
    scale=1 / 255,
    shift=0.0,
    resolution=64,
    ids=ids,
  )
  assert [m.id for m in models] == ids
  chains = pool_lib.chains(models)
  assert [len(c) for c in chains] == [6, 14]
  for m, chain in zip(models, chains):
    assert m.model.input_shape == (28, 28, 1)
    assert chain[0].in_spec == (28, 28, 1) and chain[-1].out_spec == (10,)
    assert chain[0].steps[0][0] == 'preprocess'
  # The model's preprocessing is imagenet.preprocess of the stored pixels.
  u = _reference()['up_input']  # [2, 12, 12, 1] uint8
  u = np.pad(u, ((0, 0), (8, 8), (8, 8), (0, 0)))
  alexnet = models[0]
  got = alexnet.model.apply_eval(alexnet.variables, jnp.asarray(u / 255.0))
  plain = _loaded('alexnet')
  x = imagenet.preprocess(jnp.asarray(u / 255.0), imagenet.Preprocess(64))
  want = plain.model.apply_eval(plain.variables, x)
  helpers.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_load_pool_names_what_is_missing(tmp_path):
  shutil.copy(os.path.join(DATA, 'vgg16.safetensors'), tmp_path)
  with pytest.raises(errors.ConfigError) as e:
    tvi.load_pool(str(tmp_path))
  assert 'resnet50.safetensors, densenet121.safetensors' in str(e.value)
  assert len(tvi.load_pool(str(tmp_path), ids=['vgg16'])) == 1
  with pytest.raises(errors.ConfigError, match='vgg19 not in the ImageNet'):
    tvi.load_pool(str(tmp_path), ids=['vgg19'])
  with pytest.raises(errors.ConfigError, match='is not a folder'):
    tvi.load_pool(str(tmp_path / 'nothing'))
  with pytest.raises(errors.ConfigError, match='must be ≥ 63'):
    tvi.load_pool(str(tmp_path), ids=['vgg16'], resolution=62)


def test_stitch_program_runs_on_an_imagenet_pool(small_fmnist_dir, tmp_path):
  label_map = tmp_path / 'map.json'
  label_map.write_text(json.dumps([[(t + 3) % 10] for t in range(10)]))
  args = (
    'experiments.stitch',
    f'--imagenet_pool={DATA}',
    '--imagenet_resolution=64',
    f'--data_dir={small_fmnist_dir}',
    f'--label_map={label_map}',
    '--num_clients=4',
    '--clients_per_round=2',
    '--rounds_per_selection=1',
    '--num_selections=1',
    '--max_depth=3',
    '--batch_size=16',
    '--eval_examples=100',
    f'--workdir={tmp_path / "run"}',
  )
  proc = helpers.run_module(*args)
  assert proc.returncode == 0, proc.stderr
  assert (
    'pool: 42 blocks from 5 models (resnet50: 6, densenet121: 6, '
    'mobilenet_v3_large: 10, alexnet: 6, vgg16: 14)'
  ) in proc.stdout
  results = json.load(open(tmp_path / 'run' / 'results.json'))
  assert set(results['pool_models']) == set(ARCHS)
  assert results['networks']
  # An ImageNet-pool label map must name classes the heads have.
  label_map.write_text(json.dumps([[10]] * 10))
  other = f'--workdir={tmp_path / "other"}'
  proc = helpers.run_module(*args[:-1], other, '--pool_models=alexnet')
  assert proc.returncode == 2
  assert proc.stderr.count('\n') == 1 and 'entry 0' in proc.stderr
