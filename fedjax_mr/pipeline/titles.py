"""Short texts that name a run's setting: in its log, in figures' titles.

`setting_title` is how a comparison, a run's curves.png and a landscape
title their setting; `rounds` counts rounds in words.
"""

from __future__ import annotations

from fedjax_mr.data import datasets
from fedjax_mr.pipeline import config as config_lib


def rounds(n: int) -> str:
  """`1 round`, `20 rounds`."""
  return f'{n} round' + ('' if n == 1 else 's')


# Shown by `setting_title` in its fixed part, or not a setting.
_TITLE_FIELDS = {
  'dataset',
  'model',
  'partition',
  'alpha',
  'shards_per_client',
  'partition_file',
  'partition_sha256',
  'synthetic_alpha',
  'synthetic_beta',
  'num_clients',
  'clients_per_round',
  'local_epochs',
  'batch_size',
  'lr',
  'momentum',
  'rounds',
  'algorithm',
  'seed',
  'data_dir',
  'eval_every',
  'local_eval_every',
  'eval_batch_size',
}


# The names figures and tables give the zoo's models.
MODEL_NAMES = {
  'char_lstm': 'char-LSTM',
  'cnn_cifar': 'CNN (CIFAR)',
  'cnn_fedavg': 'CNN (FedAvg)',
  'cnn_femnist': 'CNN (FEMNIST)',
  'cnn_mnist': 'CNN (MNIST)',
  'logistic': 'logistic regression',
  'resnet18': 'ResNet-18',
  'resnet18_w16': 'ResNet-18 (width 16)',
  'resnet20': 'ResNet-20',
  'vgg16': 'VGG-16',
}


def setting_title(config: config_lib.ExperimentConfig) -> str:
  """The setting a comparison ran, in the figures' names: dataset, model,
  partition (α), clients, E, B, lr, momentum, rounds, and every other
  field that defines the run and differs from its default (an algorithm's
  own fields excepted: they belong to the variants).

  E.g. 'Fashion-MNIST, CNN (MNIST), Dir(α = 0.1), K = 10 of 100, E = 5,
  B = 50, lr = 0.01, momentum = 0.9, 100 rounds'.
  """
  c = config
  part = {
    'dirichlet': f'Dir(α = {c.partition.alpha:g})',
    'dirichlet_equal': f'Dir(α = {c.partition.alpha:g}), equal sizes',
    'shards': f'{c.partition.shards_per_client} shards per client',
    'file': f'partition file {c.partition.sha256[:8]}',
    'iid': 'IID',
    'natural': 'LEAF users as clients',
  }.get(c.partition.kind, c.partition.kind)
  data = datasets.DISPLAY_NAMES.get(c.data.dataset, c.data.dataset)
  if c.data.dataset == datasets.SYNTHETIC:
    data = (
      f'{data}(α = {c.data.synthetic_alpha:g}, β = {c.data.synthetic_beta:g})'
    )
    part = ''
  title = ', '.join(
    x
    for x in (
      data,
      MODEL_NAMES.get(c.model.name, c.model.name),
      part,
      f'K = {c.server.clients_per_round} of {c.partition.num_clients}',
      f'E = {c.local.local_epochs}, B = {c.local.batch_size}, lr = '
      f'{c.local.lr:g}',
      f'momentum = {c.local.momentum:g}, {rounds(c.run.rounds)}',
    )
    if x
  )
  values = c.flat()
  extra = [
    f'{f.name}={values[f.name]}'
    for f in config_lib.base_fields()
    if not f.metadata['run_only']
    and f.name not in _TITLE_FIELDS
    and values[f.name] != f.default
  ]
  return title + ''.join(f', {e}' for e in extra)
