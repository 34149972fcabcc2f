"""The benchmark's runs built as a training run builds them: its config,
algorithms, generated clients and device mapping. (The one module of the
benchmark that reads the run pipeline.)"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from fedjax_mr.bench import setting as setting_lib
from fedjax_mr.models import model as model_lib
from fedjax_mr.pipeline import build
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import registry
from fedjax_mr.runtime import distributed

initialize = distributed.initialize
client_mapping = distributed.client_mapping


def dataset_fields() -> tuple[dataclasses.Field, ...]:
  """The experiment config's fields that only some datasets read
  (Synthetic's α and β): a benchmark setting's `dataset_options`."""
  return tuple(
    f for f in config_lib.base_fields() if f.name in checks.DATASET_FIELDS
  )


def experiment_config(
  setting: setting_lib.Setting, name: str
) -> config_lib.ExperimentConfig:
  """The experiment config of `setting` for algorithm `name`: the
  setting's hyper-parameters for its own algorithm, none for another."""
  options = setting.algorithm_options if name == setting.algorithm else {}
  return config_lib.ExperimentConfig.from_flat(
    algorithm=name,
    dataset=setting.dataset,
    model=setting.model,
    num_clients=setting.num_clients,
    clients_per_round=setting.clients_per_round,
    local_epochs=setting.local_epochs,
    batch_size=setting.batch_size,
    lr=0.01,
    momentum=0.9,
    **setting.dataset_options,
    **options,
  )


def check(setting: setting_lib.Setting) -> None:
  """Raises `errors.UserError` where the setting's experiment config (its
  algorithm, hyper-parameters, dataset and model) is not a valid run."""
  config = experiment_config(setting, setting.algorithm)
  checks.validate(config)
  checks.hparams(config)


def algorithm(
  setting: setting_lib.Setting, name: str, base: model_lib.Model
) -> tuple[Any, Any, model_lib.Model, bool]:
  """`(algorithm, its model's initial variables, that model, whether it
  keeps K models)` for registry entry `name` on zoo model `base`."""
  config = experiment_config(setting, name)
  checks.validate(config)
  model = registry.model_for(name, base, checks.hparams(config))
  variables = model.init(jax.random.key(0))
  built = build.build_algorithm(config, model, variables)
  return built, variables, model, config_lib.multi_model(config)


def generated_clients(setting: setting_lib.Setting) -> build.Clients:
  """Synthetic(α, β)'s N clients and held-out test set, as a training run
  builds them."""
  return build.load_clients(experiment_config(setting, setting.algorithm))
