"""The block pool."""

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
