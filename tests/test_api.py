"""The names the packages export resolve (they are loaded on first use)."""

import importlib

import pytest

import fedjax_mr


@pytest.mark.parametrize(
  'package',
  ['fedjax_mr', 'fedjax_mr.bench', 'fedjax_mr.core', 'fedjax_mr.training'],
)
def test_every_exported_name_resolves(package):
  module = importlib.import_module(package)
  assert module.__all__
  for name in module.__all__:
    assert getattr(module, name) is not None, name
  with pytest.raises(AttributeError):
    getattr(module, 'no_such_name')


def test_the_top_level_names_are_the_functions_documented():
  from fedjax_mr.pipeline import experiment

  assert fedjax_mr.load_run is experiment.load_run
  assert fedjax_mr.train_and_evaluate is experiment.train_and_evaluate
  # A subpackage as an attribute (`fedjax_mr.stitch` once raised).
  for name in ('algorithms', 'data', 'energy', 'models', 'stitch'):
    assert getattr(fedjax_mr, name).__name__ == f'fedjax_mr.{name}'
  assert fedjax_mr.stitch.run is fedjax_mr.stitch.federated.run
