"""The registry: every algorithm meets the contract; adding one is one
module and one registry entry (here the module is this file's toy)."""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.analysis import compare
from fedjax_mr.core import errors
from fedjax_mr.core import tree
from fedjax_mr.core import types
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import experiment
from fedjax_mr.pipeline import registry
from fedjax_mr.training import client
from tests import helpers
from tests.algorithms import contract

# ---------------------------------------------------------------------------
# A toy algorithm, written as a new contributor would: FedAvg with a server
# step size, a round-robin sampler and a per-client participation count.


class ToyState(NamedTuple):
  params: types.Variables


@dataclasses.dataclass(frozen=True)
class ToyHparams:
  step: float = 1.0

  def validate(self, **setting):
    del setting
    if not self.step > 0:
      raise errors.ArgumentError('step', f'must be > 0, got {self.step}')


def toy(local, clients_per_round, num_clients, step=1.0):
  ToyHparams(step).validate()
  k, n = clients_per_round, num_clients
  update = client.make_local_update(local)

  def sampler(key, round_index, server_state, data):
    del key, server_state, data
    return ((round_index * k + jnp.arange(k)) % n).astype(jnp.int32)

  def dispatch(state, ids, round_index, key):
    del ids, round_index, key
    return types.Dispatch(shared=state.params)

  def client_update(shared, per_client, count, data, client_id, key):
    del per_client
    return update(shared, data, client_id, key), count + 1

  def aggregate(state, outputs, ids, round_index, key):
    del ids, round_index, key
    mean = tree.weighted_mean(outputs.variables)
    params = jax.tree.map(lambda g, m: g + step * (m - g), state.params, mean)
    return ToyState(params), {
      'bytes_communicated': jnp.float32(2 * k * tree.nbytes(state.params))
    }

  return types.Algorithm(
    lambda v: ToyState(v),
    dispatch,
    client_update,
    aggregate,
    init_client_state=lambda v: jnp.zeros((), jnp.int32),
    sampler=sampler,
  )


def build_toy(setting, hp):
  return toy(
    setting.local, setting.clients_per_round, setting.num_clients, hp.step
  )


@pytest.fixture
def with_toy(monkeypatch):
  # The one registry entry.
  monkeypatch.setitem(
    registry.REGISTRY,
    'toy',
    registry.Entry(
      hparams=ToyHparams,
      factory=build_toy,
      flags={'step': registry.Flag('Server step size.')},
      label='Toy',
    ),
  )


# ---------------------------------------------------------------------------


# FedGen's server runs Adam, which turns 2-device rounding differences
# into moves of up to one learning rate (1e-4) per step, and its default
# client weights (10) amplify those in the models; with weights of 0.1 the
# 2-device run stays within 3e-4 (5 generator steps a round keep it
# short). MOON's
# contrastive gradients through a 256-wide projection of this 6-unit model
# are large enough (lr 0.1, momentum 0.9) that the 2-device program's other
# fusions grow to 3e-4 in three rounds; with a 4-wide projection they stay
# at rounding level.
_CONTRACT_HPARAMS = {
  'fedgen': dict(generative_alpha=0.1, generative_beta=0.1, generator_steps=5),
  'moon': dict(projection_dim=4),
}
_TWO_DEVICE_ATOL = {'fedgen': 3e-4}


def _factory(name):
  entry = registry.get(name)

  def build(local, k, n):
    setting = registry.Setting(
      local,
      k,
      n,
      entry.weighting == 'examples',
      local.model.init(jax.random.key(0)),
    )
    return entry.factory(
      setting, entry.hparams(**_CONTRACT_HPARAMS.get(name, {}))
    )

  return build


@pytest.mark.parametrize('name', sorted(registry.REGISTRY))
def test_every_registered_algorithm_meets_the_contract(name):
  # On the network the algorithm trains (MOON: with its projection head).
  entry = registry.get(name)
  hp = entry.hparams(**_CONTRACT_HPARAMS.get(name, {}))
  model = registry.model_for(name, helpers.linear_bn_model(), hp)
  history = contract.check_algorithm(
    _factory(name),
    model=model,
    two_device_atol=_TWO_DEVICE_ATOL.get(name, 1e-5),
  )
  assert len(history) == 3


def test_toy_meets_the_contract_with_its_state_and_sampler(with_toy):
  history = contract.check_algorithm(_factory('toy'))
  assert len(history) == 3


def test_toy_runs_through_the_experiment(with_toy, small_fmnist_dir, tmp_path):
  cfg = helpers.small_config(small_fmnist_dir, algorithm='toy', toy_step=0.5)
  assert cfg.algorithm.hparams.step == 0.5 and cfg.to_dict()['toy_step'] == 0.5
  res = experiment.train_and_evaluate(cfg, str(tmp_path), log=lambda s: None)
  # Round-robin over 10 clients, 4 a round, 3 rounds: each id once or twice.
  ids = [r['client_ids'] for r in res.history]
  assert ids == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
  np.testing.assert_array_equal(
    res.state.clients, [2, 2, 1, 1, 1, 1, 1, 1, 1, 1]
  )
  assert res.history[-1]['test_accuracy'] > 0.1
  with pytest.raises(errors.ConfigError, match='^`toy_step` must be > 0'):
    checks.validate(cfg.replace(toy_step=-1.0))
  with pytest.raises(errors.ConfigError, match='applies to `algorithm=toy`'):
    config_lib.ExperimentConfig.from_flat(algorithm='fedavg', toy_step=0.5)
  # Another algorithm in place of toy starts from its own defaults.
  assert cfg.replace(algorithm='fedavg').algorithm.options() == {}
  assert compare.parse_variant('t2:algorithm=toy,toy_step=2')[1] == {
    'algorithm': 'toy',
    'toy_step': 2.0,
  }


def test_flags_and_variants_come_from_the_registry():
  flags = registry.all_flags()
  assert flags['fedprox_mu'][1] == ('fedprox',)
  assert flags['scaffold_control_dtype'][1] == ('scaffold',)
  # One flag read by several algorithms, under its historical name.
  assert flags['fedmr_grouping'][1] == ('fedmr', 'fedmr_p', 'indep', 'fedmut')
  assert flags['fedmr_segments'][1] == ('fedmr_p',)
  assert flags['fedmr_first_stage'][1] == ('fedmr', 'fedmr_p', 'indep')
  variants = registry.variants()
  for name in registry.REGISTRY:
    assert variants[name] == {'algorithm': name}
  assert variants['fedmr_p2'] == {'algorithm': 'fedmr_p', 'fedmr_segments': 2}
  assert variants['fedmut_a2'] == {'algorithm': 'fedmut', 'fedmut_alpha': 2.0}
  assert variants['fedgen_a1'] == {
    'algorithm': 'fedgen',
    'fedgen_generative_alpha': 1.0,
    'fedgen_generative_beta': 1.0,
  }
  assert compare.VARIANTS == variants


def test_every_hyper_parameter_has_its_flag_text_in_the_registry():
  # The module holds the field; the entry, its flag's help (and choices).
  for name, entry in registry.REGISTRY.items():
    fields = {f.name for f in dataclasses.fields(entry.hparams)}
    assert set(entry.flags) == fields, name
    for flag, f in registry.flags_of(name).items():
      assert f.help and not f.field.metadata, (name, flag)
  assert registry.flags_of('fedmut')['fedmr_grouping'].choices == (
    'leaf',
    'module',
  )


def test_display_names():
  # Every entry has a label of its own, and no two are alike.
  labels = [entry.label for entry in registry.REGISTRY.values()]
  assert all(labels) and len(set(labels)) == len(labels)
  assert [
    registry.display_name(n)
    for n in ('fedavg', 'scaffold', 'fedexp', 'fedasam', 'clusamp', 'moon')
  ] == ['FedAvg', 'SCAFFOLD', 'FedExP', 'FedASAM', 'CluSamp', 'MOON']
  # Variants: the label and the flags they set, without the prefix.
  assert registry.display_name('fedmr_2stage20') == 'FedMR (first_stage=20)'
  assert registry.display_name('fedmr_p2') == 'FedMR-p (segments=2)'
  assert registry.display_name('fedmut_a0') == 'FedMut (alpha=0)'
  assert (
    registry.display_name('scaffold_taken') == 'SCAFFOLD (control_steps=taken)'
  )
  assert registry.display_name('fedgen_a1') == (
    'FedGen (generative_alpha=1, generative_beta=1)'
  )
  assert registry.display_name('my_variant') == 'my_variant'
  # A variant with a name of its own (FedAdam is FedAvg with Adam on the
  # server) is called by it; every label stays unique.
  assert registry.display_name('fedadam') == 'FedAdam'
  assert registry.display_name('fedavgm') == 'FedAvgM'
  variant_labels = [
    label
    for entry in registry.REGISTRY.values()
    for label in entry.variant_labels.values()
  ]
  assert len(set(labels + variant_labels)) == len(labels + variant_labels)
  for entry in registry.REGISTRY.values():
    assert set(entry.variant_labels) <= set(entry.variants)


def test_config_accepts_flags_and_rejects_unknown_names():
  cfg = config_lib.ExperimentConfig.from_flat(
    algorithm='scaffold', scaffold_control_steps='taken'
  )
  options = cfg.algorithm.options()
  assert options['scaffold_control_steps'] == 'taken'
  assert cfg.replace(seed=3).algorithm.options() == options
  with pytest.raises(TypeError, match='no_such_flag'):
    config_lib.ExperimentConfig.from_flat(no_such_flag=1)
  with pytest.raises(AttributeError):
    cfg.no_such_flag  # noqa: B018
  with pytest.raises(AttributeError):  # the flags are not attributes
    cfg.scaffold_control_steps  # noqa: B018
  assert config_lib.uniform_weights(cfg)
  assert not config_lib.uniform_weights(
    cfg.replace(algorithm='fedprox', scaffold_control_steps='effective')
  )


def test_algorithm_errors_name_their_field():
  bad = [
    ({'algorithm': 'fedprox', 'fedprox_mu': -1.0}, '`fedprox_mu` must be'),
    (
      {'algorithm': 'scaffold', 'scaffold_control_dtype': 'int8'},
      '`scaffold_control_dtype`: unknown value',
    ),
    ({'algorithm': 'fedmut', 'fedmut_alpha': float('nan')}, '`fedmut_alpha`'),
    (
      {
        'algorithm': 'fedmr',
        'fedmr_secure_repeats': 1,
        'weighting': 'examples',
      },
      '`weighting` by examples is not available',
    ),
  ]
  for changes, message in bad:
    cfg = config_lib.ExperimentConfig.from_flat(**changes)
    with pytest.raises(errors.ConfigError, match='^' + message):
      checks.validate(cfg)


@pytest.mark.parametrize('name', sorted(registry.REGISTRY))
def test_each_hyper_parameter_rule_runs_once_per_run(name, monkeypatch):
  # The config's checks validate the hyper-parameters; the registry's
  # factory builds from them without validating again.
  from fedjax_mr.models import model as model_lib
  from fedjax_mr.pipeline import build

  entry = registry.get(name)
  calls = []
  validate = entry.hparams.validate

  def counted(self, **setting):
    calls.append(name)
    return validate(self, **setting)

  monkeypatch.setattr(entry.hparams, 'validate', counted)
  config = config_lib.ExperimentConfig.from_flat(
    algorithm=name, partition='iid', num_clients=20, clients_per_round=4
  )
  hp = checks.validate(config)
  assert calls == [name]
  model = registry.model_for(
    name, model_lib.get(config.model.name, 10, (28, 28, 1)), hp
  )
  build.build_algorithm(config, model, model.init(jax.random.key(0)), hp)
  assert calls == [name]
