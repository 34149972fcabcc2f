"""fedjax_mr: federated learning by model recombination, mutation and
stitching, in JAX.

Subpackages, by layer (each imports only the layers below it): `core`
(interfaces, tree helpers, errors, files); `data`, `models`, `energy`
(host-only Jetson energy tools; never imports jax) and `privacy` (the
clip and noise of differential privacy, its accountant); `training` (local
training, optimizers, the round engine); `algorithms` (one module per
algorithm) and `stitch` (FedStitch); `runtime` (what a run keeps and
where it runs: checkpoints, metrics files, figures of them, TensorBoard,
provenance, devices and processes); `pipeline` (the run pipeline: the
registry, the experiment configs, the host loop, resume and records, for
training runs and FedStitch runs); `analysis` (what is read from finished
runs: comparisons, probes, landscapes, FedStitch's tables and figures);
`bench` (the benchmark of a round against its limit); `deploy` (the run
pipeline's runs on a Flower federation; the `deploy` extra). The programs
in `experiments/` call the last four.

The names below are loaded on first use, so `import fedjax_mr.energy` does
not import jax.
"""

import importlib

__version__ = '0.1.0'

_SUBPACKAGES = (
  'algorithms',
  'analysis',
  'bench',
  'core',
  'data',
  'deploy',
  'energy',
  'models',
  'pipeline',
  'privacy',
  'runtime',
  'stitch',
  'training',
)

# Re-exported names: name -> (module, attribute).
_EXPORTS = {
  'ClientData': ('fedjax_mr.data.client_data', 'ClientData'),
  'ClientOutput': ('fedjax_mr.core.types', 'ClientOutput'),
  'Algorithm': ('fedjax_mr.core.types', 'Algorithm'),
  'Dispatch': ('fedjax_mr.core.types', 'Dispatch'),
  'ExperimentConfig': ('fedjax_mr.pipeline.config', 'ExperimentConfig'),
  'RoundState': ('fedjax_mr.training.engine', 'RoundState'),
  'load_dataset': ('fedjax_mr.data.datasets', 'load'),
  'from_partition': ('fedjax_mr.data.client_data', 'from_partition'),
  'eval_data': ('fedjax_mr.data.client_data', 'eval_data'),
  'get_model': ('fedjax_mr.models.model', 'get'),
  'fedavg': ('fedjax_mr.algorithms.fedavg', 'fedavg'),
  'LocalTraining': ('fedjax_mr.training.client', 'LocalTraining'),
  'optimizers': ('fedjax_mr.training', 'optimizers'),
  'make_local_update': ('fedjax_mr.training.client', 'make_local_update'),
  'make_client_update': ('fedjax_mr.training.client', 'make_client_update'),
  'make_round_fn': ('fedjax_mr.training.engine', 'make_round_fn'),
  'make_evaluate': ('fedjax_mr.training.evaluation', 'make_evaluate'),
  'init_state': ('fedjax_mr.training.engine', 'init_state'),
  'setup': ('fedjax_mr.pipeline.experiment', 'setup'),
  'train_and_evaluate': ('fedjax_mr.pipeline.experiment', 'train_and_evaluate'),
  'load_run': ('fedjax_mr.pipeline.experiment', 'load_run'),
}

__all__ = sorted(_EXPORTS) + list(_SUBPACKAGES)


def __getattr__(name):
  if name in _SUBPACKAGES:
    return importlib.import_module(f'fedjax_mr.{name}')
  if name in _EXPORTS:
    module, attr = _EXPORTS[name]
    return getattr(importlib.import_module(module), attr)
  raise AttributeError(f'module fedjax_mr has no attribute {name!r}')


def __dir__():
  return __all__
