"""Local training, the round engine, evaluation and the experiment loop.

Names are loaded on first use (the algorithms import `training.client`,
and the experiment imports the algorithms).
"""

import importlib

_MODULES = (
  'checkpoint',
  'client',
  'compare',
  'config',
  'distributed',
  'engine',
  'experiment',
  'landscape',
  'metrics_io',
  'optimizers',
  'plots',
  'provenance',
  'tensorboard',
)
_EXPORTS = {
  'LocalTraining': ('client', 'LocalTraining'),
  'make_local_update': ('client', 'make_local_update'),
  'make_client_update': ('client', 'make_client_update'),
  'ExperimentConfig': ('config', 'ExperimentConfig'),
  'RoundState': ('engine', 'RoundState'),
  'init_state': ('engine', 'init_state'),
  'make_evaluate': ('engine', 'make_evaluate'),
  'make_round_fn': ('engine', 'make_round_fn'),
  'setup': ('experiment', 'setup'),
  'train_and_evaluate': ('experiment', 'train_and_evaluate'),
  'load_run': ('experiment', 'load_run'),
  'FinishedRun': ('experiment', 'FinishedRun'),
}

__all__ = sorted(_EXPORTS) + list(_MODULES)


def __getattr__(name):
  if name in _MODULES:
    return importlib.import_module(f'fedjax_mr.training.{name}')
  if name in _EXPORTS:
    module, attr = _EXPORTS[name]
    return getattr(
      importlib.import_module(f'fedjax_mr.training.{module}'), attr
    )
  raise AttributeError(f'module fedjax_mr.training has no attribute {name!r}')


def __dir__():
  return __all__
