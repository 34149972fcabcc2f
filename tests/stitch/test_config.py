"""FedStitch's hyper-parameter checks."""

import re

import pytest

from fedjax_mr.core import errors
from fedjax_mr.stitch import config as config_lib

_CONFIG_ERRORS = [
  ('clients_per_round', 0, '`clients_per_round`'),
  ('batch_size', 1, '`batch_size`'),
  ('batch_size', config_lib.MAX_BATCH_SIZE + 1, '`batch_size`'),
  ('top_k', 0, '`top_k`'),
  ('epsilon', -0.1, '`epsilon`'),
  ('epsilon', 1.5, '`epsilon`'),
  ('epsilon_decay', 0.0, '`epsilon_decay`'),
  ('epsilon_decay', 1.5, '`epsilon_decay`'),
  ('reward', -0.1, '`reward`'),
  ('penalty', 1.0, '`penalty`'),
  ('penalty', -0.1, '`penalty`'),
  ('threshold', 1.5, '`threshold`'),
  ('aggregation', 'mean', '`aggregation`'),
  ('num_selections', 0, '`num_selections`'),
  ('rounds_per_selection', 0, '`rounds_per_selection`'),
  ('max_depth', 1, '`max_depth`'),
  ('view', 'pixels', '`view`'),
  ('spatial', 'crop', '`spatial`'),
  ('solver', 'lsqr', '`solver`'),
]


@pytest.mark.parametrize(
  'field,value,name',
  _CONFIG_ERRORS,
  ids=[f'{f}={v}' for f, v, _ in _CONFIG_ERRORS],
)
def test_check_config_names_the_field(field, value, name):
  config = config_lib.Config()._replace(**{field: value})
  with pytest.raises(errors.ConfigError, match=re.escape(name) + ' must'):
    config_lib.check_config(config, 10)


def test_check_config_accepts_defaults_and_edges():
  config_lib.check_config(config_lib.Config(), 1)
  config_lib.check_config(
    config_lib.Config(epsilon=1.0, epsilon_decay=1.0, penalty=0.0, max_depth=2),
    1,
  )
  config_lib.check_config(
    config_lib.Config(batch_size=config_lib.MAX_BATCH_SIZE),
    config_lib.MAX_CLIENTS,
  )
  with pytest.raises(errors.ConfigError, match='client'):
    config_lib.check_config(config_lib.Config(), 0)
  with pytest.raises(errors.ConfigError, match='`num_clients` must be at most'):
    config_lib.check_config(config_lib.Config(), config_lib.MAX_CLIENTS + 1)


@pytest.mark.parametrize(
  'field', ['epsilon', 'epsilon_decay', 'reward', 'penalty', 'threshold']
)
@pytest.mark.parametrize('value', [float('nan'), float('inf')])
def test_check_config_refuses_non_finite_rates(field, value):
  config = config_lib.Config()._replace(**{field: value})
  with pytest.raises(errors.ConfigError, match=f'`{field}` must be finite'):
    config_lib.check_config(config, 10)


def test_check_config_speaks_the_callers_names():
  config = config_lib.Config(solver='lsqr')
  with pytest.raises(errors.ConfigError, match='^`stitch_solver` must be one'):
    config_lib.check_config(config, 10, names={'solver': 'stitch_solver'})
