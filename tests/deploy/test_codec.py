"""Pytrees as Flower array records: exact round trips, and every malformed
record refused before its values are used."""

import io

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flwr.app import Array
from flwr.app import ArrayRecord

from fedjax_mr.deploy import codec


def _tree():
  return {
    'params': {
      'dense': {
        'kernel': np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
        'bias': np.array([1.5, -2.25], dtype=ml_dtypes.bfloat16),
      }
    },
    'count': np.int32(5),
    'steps': (np.array([1, 2], np.int32),),
  }


def test_round_trip_is_exact_with_bfloat16_restored():
  tree = _tree()
  back = codec.decode(codec.encode(tree), tree)
  assert jax.tree.structure(back) == jax.tree.structure(tree)
  for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
    assert got.dtype == np.asarray(want).dtype
    assert got.shape == np.shape(want)
    assert got.tobytes() == np.asarray(want).tobytes()


def test_shape_dtype_structs_are_templates():
  tree = _tree()
  template = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree
  )
  back = codec.decode(codec.encode(tree), template)
  assert back['params']['dense']['bias'].dtype == jnp.bfloat16


def test_typed_keys_travel_as_key_data():
  key = jax.random.key(3)
  data = jax.random.key_data(key)
  back = codec.decode(codec.encode({'k': key}), {'k': data})
  np.testing.assert_array_equal(back['k'], data)


def _with(record, key, array):
  out = ArrayRecord()
  for k in record:
    out[k] = array if k == key else record[k]
  return out


@pytest.mark.parametrize(
  'change, words',
  [
    (lambda t: t['params']['dense'].pop('bias'), 'missing'),
    (lambda t: t.update(extra=np.zeros(2, np.float32)), 'unexpected'),
    (lambda t: t.update(count=np.float32(5)), 'expected int32'),
    (
      lambda t: t['params']['dense'].update(
        kernel=np.zeros((4, 3), np.float32)
      ),
      r'expected float32\[3, 4\]',
    ),
  ],
)
def test_wrong_tree_shape_or_dtype_is_refused(change, words):
  sent = _tree()
  reply = _tree()
  change(reply)
  with pytest.raises(codec.ReplyError, match=words):
    codec.decode(codec.encode(reply), sent)


def test_leaves_out_of_order_are_refused():
  sent = _tree()
  record = codec.encode(sent)
  swapped = ArrayRecord()
  for k in reversed(list(record)):
    swapped[k] = record[k]
  with pytest.raises(codec.ReplyError, match='out of order'):
    codec.decode(swapped, sent)


@pytest.mark.parametrize('bad', [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused(bad):
  sent = _tree()
  reply = _tree()
  reply['params']['dense']['kernel'][1, 2] = bad
  with pytest.raises(codec.ReplyError, match=r"\['kernel'\] holds non-finite"):
    codec.decode(codec.encode(reply), sent)


def test_non_finite_bfloat16_is_refused():
  sent = _tree()
  reply = _tree()
  reply['params']['dense']['bias'][0] = np.inf
  with pytest.raises(codec.ReplyError, match='non-finite'):
    codec.decode(codec.encode(reply), sent)


def test_oversize_leaf_is_refused_before_it_is_read():
  sent = _tree()
  record = codec.encode(sent)
  key = "['params']['dense']['kernel']"
  good = record[key]
  padded = Array(
    dtype=good.dtype,
    shape=good.shape,
    stype=good.stype,
    data=good.data + bytes(codec.NPY_HEADER_BYTES + 1),
  )
  with pytest.raises(codec.ReplyError, match='bytes'):
    codec.decode(_with(record, key, padded), sent)
  assert codec.payload_bytes(record) <= codec.max_bytes(sent)


def test_data_that_disagrees_with_its_header_is_refused():
  # The Array says float32[3, 4]; its bytes hold a float64 [3, 4] array.
  sent = _tree()
  record = codec.encode(sent)
  key = "['params']['dense']['kernel']"
  buffer = io.BytesIO()
  np.save(buffer, np.zeros((3, 4), np.float64))
  forged = Array(
    dtype='float32',
    shape=(3, 4),
    stype=record[key].stype,
    data=buffer.getvalue(),
  )
  with pytest.raises(codec.ReplyError, match='reads as float64'):
    codec.decode(_with(record, key, forged), sent)


def test_data_of_another_shape_than_its_header_is_refused():
  # The Array says float32[3, 4]; its bytes hold a float32 [4, 3] array.
  sent = _tree()
  record = codec.encode(sent)
  key = "['params']['dense']['kernel']"
  buffer = io.BytesIO()
  np.save(buffer, np.zeros((4, 3), np.float32))
  forged = Array(
    dtype='float32',
    shape=(3, 4),
    stype=record[key].stype,
    data=buffer.getvalue(),
  )
  with pytest.raises(codec.ReplyError, match=r'reads as float32\[4, 3\]'):
    codec.decode(_with(record, key, forged), sent)


def test_a_pickle_is_never_unpickled(tmp_path):
  marker = tmp_path / 'ran'

  class Payload:
    def __reduce__(self):
      return (marker.write_text, ('x',))

  sent = {'w': np.zeros((2,), np.float32)}
  record = codec.encode(sent)
  buffer = io.BytesIO()
  np.save(buffer, np.array([Payload()], dtype=object), allow_pickle=True)
  forged = Array(
    dtype='float32',
    shape=(2,),
    stype=record["['w']"].stype,
    data=buffer.getvalue(),
  )
  with pytest.raises(codec.ReplyError, match='does not read'):
    codec.decode(_with(record, "['w']", forged), sent)
  assert not marker.exists()


def test_not_a_record_is_refused():
  with pytest.raises(codec.ReplyError, match='not an ArrayRecord'):
    codec.decode({'w': 1}, {'w': np.zeros(1)})
