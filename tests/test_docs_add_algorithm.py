"""The "Add an algorithm" how-to's example, run as written: its module and
its registry entry, through the experiment and the shared contract."""

import importlib.util
import os
import re
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.pipeline import experiment
from fedjax_mr.pipeline import registry
from tests import helpers
from tests.algorithms import contract

PAGE = os.path.join(
  os.path.dirname(os.path.dirname(__file__)),
  'docs',
  'howto',
  'add-algorithm.md',
)


def _blocks() -> tuple[str, str]:
  """The example's module and its registry entry, as the how-to prints
  them (its first two Python blocks)."""
  with open(PAGE) as f:
    text = f.read()
  module, entry = re.findall(r'```python\n(.*?)```', text, re.S)[:2]
  assert module.startswith('# fedjax_mr/algorithms/fedclip.py')
  return module, entry


def _import(path, name):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


@pytest.fixture
def fedclip(tmp_path, monkeypatch):
  """The example module, imported, and its entry in the registry."""
  module_text, entry_text = _blocks()
  (tmp_path / 'fedclip.py').write_text(module_text)
  (tmp_path / 'fedclip_entry.py').write_text(
    'from fedjax_mr.pipeline.registry import Entry, Flag\n'
    'import fedclip\n'
    f'ENTRIES = {{\n{entry_text}}}\n'
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  module = _import(tmp_path / 'fedclip.py', 'fedclip')
  entries = _import(tmp_path / 'fedclip_entry.py', 'fedclip_entry').ENTRIES
  for name, entry in entries.items():
    monkeypatch.setitem(registry.REGISTRY, name, entry)
  yield module
  sys.modules.pop('fedclip', None)
  sys.modules.pop('fedclip_entry', None)


def test_clip_update_by_hand(fedclip):
  g = {'w': jnp.array([0.0, 0.0])}
  far = fedclip.clip_update(g, {'w': jnp.array([3.0, 4.0])}, 1.0)  # norm 5
  near = fedclip.clip_update(g, {'w': jnp.array([0.3, 0.4])}, 1.0)  # 0.5
  helpers.assert_close(far['w'], [0.6, 0.8], rtol=1e-6)
  helpers.assert_close(near['w'], [0.3, 0.4], rtol=1e-6)


def test_the_example_runs_through_the_experiment(
  fedclip, small_fmnist_dir, tmp_path
):
  assert registry.display_name('fedclip') == 'FedClip'
  cfg = helpers.small_config(
    small_fmnist_dir,
    algorithm='fedclip',
    fedclip_clip=0.5,
    server_optimizer='adam',
    server_lr=0.01,
    rounds=2,
  )
  res = experiment.train_and_evaluate(cfg, str(tmp_path), log=lambda s: None)
  assert len(res.history) == 2
  assert all(np.isfinite(r['train_loss']) for r in res.history)


@pytest.mark.slow
def test_the_example_keeps_the_contract(fedclip):
  contract.check_algorithm(lambda local, k, n: fedclip.fedclip(local, k, 0.1))


def test_a_large_bound_is_fedavg(fedclip):
  model = helpers.linear_model()
  data, _ = helpers.toy_data([5, 9, 3, 12])
  local = contract.local_training(model)
  got, want = contract.server_params_after(
    [fedclip.fedclip(local, 4, clip=1e9), fedavg.fedavg(local, 4)], model, data
  )
  helpers.assert_close(got, want, rtol=1e-6, atol=1e-7)
