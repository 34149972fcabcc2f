"""Tables of the documentation whose every figure is computed, not
measured: each is recomputed here from the code it describes, on
whichever page it is (tests/test_results_tables_tight.py changes each
figure by one unit to show these checks catch it)."""

import functools

import jax
import numpy as np

from fedjax_mr import models
from tests import docs_text
from tests import test_readme_records as records
from tests.energy import test_simulation

# The models of the per-client state table: (classes, example shape) as
# their datasets give them.
MODELS = {
  'cnn_mnist': (10, (28, 28, 1)),
  'cnn_cifar': (10, (32, 32, 3)),
  'cnn_femnist': (62, (28, 28, 1)),
  'resnet20': (10, (32, 32, 3)),
  'char_lstm': (80, (80,)),
  'cnn_fedavg': (10, (28, 28, 1)),
  'resnet18': (10, (32, 32, 3)),
  'vgg16': (10, (32, 32, 3)),
}
STATE = '| model | parameters | N = 100 |'
ENERGY = '| PowerUp reading | deadline |'


@functools.cache
def _parameters(name):
  """The number of trainable parameters of zoo model `name`."""
  classes, shape = MODELS[name]
  model = models.get(name, classes, shape)
  variables = jax.eval_shape(model.init, jax.random.key(0))
  return sum(
    int(np.prod(x.shape)) for x in jax.tree.leaves(variables['params'])
  )


def _size(num_bytes):
  """Bytes as the table prints them: whole MiB below a GiB, else GiB to
  one decimal below 100 and whole (with thousands' commas) above."""
  mib = num_bytes / 2**20
  if mib < 1024:
    return f'{mib:.0f} MiB'
  gib = mib / 1024
  return f'{gib:.1f} GiB' if gib < 100 else f'{gib:,.0f} GiB'


def check_state_table(text):
  """The client-state memory table in text `text`: one model's trainable
  parameters per client, float32 (bfloat16 in the last column)."""
  table = records._table(text, STATE)
  header, body = table[0], table[1:]
  assert header == [
    'model',
    'parameters',
    'N = 100',
    'N = 10,000',
    'N = 10,000, bfloat16',
  ]
  assert [row[0] for row in body] == list(MODELS)
  for name, *cells in body:
    n = _parameters(name)
    assert cells == [
      f'{n:,}',
      _size(4 * n * 100),
      _size(4 * n * 10_000),
      _size(2 * n * 10_000),
    ], name


READINGS = {'literal': 'tx2_literal', 'chained': 'tx2_chained'}
DEADLINES = {
  "paper rule (last round's slowest)": 'previous',
  "oracle (this round's default time)": 'oracle',
}


def check_energy_table(text):
  """The energy module's simulated scenario in text `text`, each row
  simulated again (tests/energy/test_simulation.py's scenario)."""
  table = records._table(text, ENERGY)
  assert table[0] == [
    'PowerUp reading',
    'deadline',
    'energy saving',
    'round time',
  ]
  rows = table[1:]
  assert len(rows) == 4
  for reading, deadline, saving, time in rows:
    report = test_simulation.docs_scenario(
      READINGS[reading], DEADLINES[deadline]
    )
    assert saving.strip('*') == f'{100 * report.energy_saving:.1f} %', reading
    assert time == f'{100 * report.time_change:+.1f} %', reading


# Each table's header line (its start) and its check.
TABLES = {STATE: check_state_table, ENERGY: check_energy_table}


def test_the_client_state_table_is_computed_from_the_models():
  check_state_table(docs_text.read(docs_text.holding(STATE)))


def test_the_energy_scenario_table_is_simulated_again():
  check_energy_table(docs_text.read(docs_text.holding(ENERGY)))
