"""The block pool."""

import json

import pytest

from fedjax_mr.core import errors
from fedjax_mr.stitch import pool as pool_lib
from tests.stitch import common


def test_make_pool():
  pool = common.fake_pool()
  assert pool.models == ('a', 'b', 'c')
  assert len(pool.blocks) == 9
  assert pool.ids_of('b') == [3, 4, 5]
  assert pool.starts() == [0, 3, 6]
  chain = list(pool.blocks[:3])
  with pytest.raises(errors.ConfigError, match='unique'):
    pool_lib.make_pool([chain, chain])
  other = [common.block('d', 0, 'start', (32, 32, 3), (4,))]
  with pytest.raises(errors.ConfigError, match='different inputs'):
    pool_lib.make_pool([chain, other])


_META = {'model': 'cnn_mnist', 'num_classes': 10, 'input_shape': [28, 28, 1]}


def _meta(tmp_path, content):
  folder = tmp_path / 'm'
  folder.mkdir(exist_ok=True)
  text = content if isinstance(content, str) else json.dumps(content)
  (folder / 'meta.json').write_text(text)
  return str(folder / 'meta.json')


@pytest.mark.parametrize(
  'content,reason',
  [
    ('{"model": ', 'not JSON (Expecting value: line 1 column 11 (char 10))'),
    ([1, 2], 'holds a list, not an object'),
    ({**_META, 'num_classes': 'abc'}, '"num_classes" is the string "abc", not'),
    ({**_META, 'num_classes': True}, '"num_classes" is true, not an integer'),
    ({**_META, 'num_classes': 1}, '"num_classes" is 1, not in [2, 1048576]'),
    ({**_META, 'model': 'nope'}, '"model" is the string "nope", not a zoo'),
    ({**_META, 'model': 3}, '"model" is the number 3, not a string'),
    ({**_META, 'input_shape': 28}, '"input_shape" is the number 28, not a'),
    ({**_META, 'input_shape': [28, '28', 1]}, '"input_shape"[1] is the string'),
    ({**_META, 'input_shape': [28, 0, 1]}, '"input_shape"[1] is 0, not in'),
    ({**_META, 'input_shape': []}, '"input_shape" has 0 entries, not 1 to 3'),
    ({**_META, 'classes': [0, 'a']}, '"classes"[1] is the string "a", not'),
    ({'model': 'cnn_mnist'}, 'has no "num_classes" (want an integer)'),
  ],
)
def test_a_malformed_meta_json_is_one_line_naming_file_and_field(
  tmp_path, content, reason
):
  path = _meta(tmp_path, content)
  with pytest.raises(errors.DataError) as e:
    pool_lib.load_model(str(tmp_path), 'm')
  assert str(e.value).startswith(f'`pool`: {path}: {reason}'), str(e.value)


def test_a_meta_json_that_is_a_folder_is_named(tmp_path):
  (tmp_path / 'm' / 'meta.json').mkdir(parents=True)
  with pytest.raises(errors.DataError, match='meta.json: is a folder'):
    pool_lib.load_model(str(tmp_path), 'm')


def test_missing_or_unreadable_variables_are_one_line(tmp_path):
  _meta(tmp_path, _META)
  variables = tmp_path / 'm' / 'variables'
  with pytest.raises(errors.DataError) as e:
    pool_lib.load_model(str(tmp_path), 'm')
  assert str(e.value) == (
    f'`pool`: {variables}: no such folder (want the orbax checkpoint of '
    'the variables beside meta.json)'
  )
  variables.mkdir()
  (variables / 'garbage').write_text('x')
  with pytest.raises(errors.DataError) as e:
    pool_lib.load_model(str(tmp_path), 'm')
  assert str(e.value).startswith(
    f'`pool`: {variables}: cannot restore it as the variables of a '
    'cnn_mnist model ('
  )
  assert '\n' not in str(e.value)


def test_public_indices_are_checked(tmp_path):
  path = tmp_path / 'public.json'
  assert pool_lib.public_indices(str(tmp_path)) is None
  path.write_text('{"dataset": "fmnist", "indices": [0, 3]}')
  assert pool_lib.public_indices(str(tmp_path))['indices'] == [0, 3]
  for indices, reason in [
    ('"0 3"', '"indices" is the string "0 3", not a list'),
    ('[0, -1]', '"indices"[1] is -1, not in [0, 2**31)'),
    ('[0, 1.5]', '"indices"[1] is the number 1.5, not an integer'),
  ]:
    path.write_text(f'{{"indices": {indices}}}')
    with pytest.raises(errors.DataError) as e:
      pool_lib.public_indices(str(tmp_path))
    assert str(e.value) == f'`pool`: {path}: {reason}'
