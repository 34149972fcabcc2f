"""The algorithms the experiment programs know, one line each.

An entry names the algorithm's hyper-parameter dataclass (each field is a
config field `<prefix>_<field>`, or the field's `metadata['flag']`, and a
flag of the programs), its factory `factory(setting, hparams) ->
Algorithm`, its default aggregation weights ('examples' or 'uniform', what
`weighting=auto` means for it), whether it keeps K different models (their
accuracies are then evaluated too), named variants for
`experiments.compare`, optionally how it changes the network the clients
train (MOON's projection head), its name in figures and tables
(`display_name`) and whether it takes a server optimizer. The flags of
`experiments.run`, the list of `algorithm` choices and compare's variants
are generated from here; adding an algorithm is one module and one entry
below.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable
from typing import Mapping
from typing import NamedTuple

import optax

from fedjax_mr.algorithms import clusamp
from fedjax_mr.algorithms import depthfl
from fedjax_mr.algorithms import fedasam
from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import fedepth
from fedjax_mr.algorithms import fedexp
from fedjax_mr.algorithms import fedgen
from fedjax_mr.algorithms import fedmr
from fedjax_mr.algorithms import fedmut
from fedjax_mr.algorithms import fedprox
from fedjax_mr.algorithms import finetune
from fedjax_mr.algorithms import heterofl
from fedjax_mr.algorithms import moon
from fedjax_mr.algorithms import scaffold
from fedjax_mr.core import types
from fedjax_mr.models import model as model_lib
from fedjax_mr.training import client


class Setting(NamedTuple):
  """What a factory builds an algorithm for (beside its hyper-parameters).

  Attributes:
    local: how clients train.
    clients_per_round: K.
    num_clients: N.
    weighted: aggregate by numbers of examples (else the plain mean).
    variables: the initial model as `model.init` returns it (its key order
      is the model's layer order).
    server_optimizer: the server's step on the pseudo-gradient, for the
      entries with `server_optimizer=True`; None: SGD at rate 1 (the
      plain aggregate).
  """

  local: client.LocalTraining
  clients_per_round: int
  num_clients: int
  weighted: bool
  variables: types.Variables
  server_optimizer: optax.GradientTransformation | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
  """One algorithm of the registry (see the module docstring).

  Attributes:
    hparams: the hyper-parameter dataclass (its fields are the flags).
    factory: `factory(setting, hparams) -> Algorithm`.
    label: the name in figures and tables ('FedMR').
    weighting: 'examples' or 'uniform', what weighting 'auto' means.
    multi_model: keeps K different models (their accuracies are evaluated).
    prefix: the flags' prefix ('' means the registry name).
    variants: compare's named variants, `{name: {flag: value}}`.
    variant_labels: a variant's name in figures, where it has one of its
      own ('FedAdam'); the others are named by the fields they change.
    model: `model(zoo model, hparams) -> the network the algorithm trains`;
      None: the zoo model unchanged.
    server_optimizer: the factory takes `Setting.server_optimizer` (its
      server steps toward an aggregate of the clients' models).
  """

  hparams: type
  factory: Callable[[Setting, Any], types.Algorithm]
  label: str
  weighting: str = 'examples'
  multi_model: bool = False
  prefix: str = ''
  variants: Mapping[str, Mapping[str, Any]] = dataclasses.field(
    default_factory=dict
  )
  variant_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
  model: Callable[[model_lib.Model, Any], model_lib.Model] | None = None
  server_optimizer: bool = False


REGISTRY: dict[str, Entry] = {
  'fedavg': Entry(
    hparams=fedavg.Hparams,
    factory=fedavg.build,
    label='FedAvg',
    variants=fedavg.VARIANTS,
    variant_labels=fedavg.VARIANT_LABELS,
    server_optimizer=True,
  ),
  'fedprox': Entry(
    hparams=fedprox.Hparams,
    factory=fedprox.build,
    label='FedProx',
    server_optimizer=True,
  ),
  'fedexp': Entry(
    hparams=fedexp.Hparams,
    factory=fedexp.build,
    label='FedExP',
    weighting='uniform',
    server_optimizer=True,
  ),
  'fedasam': Entry(
    hparams=fedasam.Hparams,
    factory=fedasam.build,
    label='FedASAM',
    server_optimizer=True,
  ),
  'fedsam': Entry(
    hparams=fedasam.SamHparams,
    factory=fedasam.build_sam,
    label='FedSAM',
    server_optimizer=True,
  ),
  'fedgen': Entry(
    hparams=fedgen.Hparams,
    factory=fedgen.build,
    label='FedGen',
    variants=fedgen.VARIANTS,
  ),
  'clusamp': Entry(
    hparams=clusamp.Hparams,
    factory=clusamp.build,
    label='CluSamp',
    weighting='uniform',
    variants=clusamp.VARIANTS,
    server_optimizer=True,
  ),
  'moon': Entry(
    hparams=moon.Hparams,
    factory=moon.build,
    label='MOON',
    model=moon.wrap_model,
    server_optimizer=True,
  ),
  'scaffold': Entry(
    hparams=scaffold.Hparams,
    factory=scaffold.build,
    label='SCAFFOLD',
    weighting='uniform',
    variants=scaffold.VARIANTS,
    server_optimizer=True,
  ),
  'fedmr': Entry(
    hparams=fedmr.Hparams,
    factory=fedmr.build,
    label='FedMR',
    weighting='uniform',
    multi_model=True,
    variants=fedmr.VARIANTS,
  ),
  'fedmr_p': Entry(
    hparams=fedmr.PHparams,
    factory=fedmr.build_p,
    label='FedMR-p',
    weighting='uniform',
    multi_model=True,
    prefix='fedmr',
    variants=fedmr.P_VARIANTS,
  ),
  'indep': Entry(
    hparams=fedmr.Hparams,
    factory=fedmr.build_indep,
    label='Indep',
    weighting='uniform',
    multi_model=True,
    prefix='fedmr',
  ),
  'fedmut': Entry(
    hparams=fedmut.Hparams,
    factory=fedmut.build,
    label='FedMut',
    weighting='uniform',
    multi_model=True,
    variants=fedmut.VARIANTS,
    server_optimizer=True,
  ),
  'depthfl': Entry(
    hparams=depthfl.Hparams,
    factory=depthfl.build,
    label='DepthFL',
    variants=depthfl.VARIANTS,
    model=depthfl.wrap_model,
  ),
  'heterofl': Entry(
    hparams=heterofl.Hparams,
    factory=heterofl.build,
    label='HeteroFL',
    weighting='uniform',
  ),
  'fedepth': Entry(
    hparams=fedepth.Hparams, factory=fedepth.build, label='FeDepth'
  ),
  'ft_full': Entry(
    hparams=finetune.Hparams,
    factory=finetune.build_full,
    label='FT-Full',
    prefix='ft',
  ),
  'ft_part': Entry(
    hparams=finetune.PartHparams,
    factory=finetune.build_part,
    label='FT-Part',
    prefix='ft',
  ),
}


def names() -> tuple[str, ...]:
  return tuple(REGISTRY)


def get(name: str) -> Entry:
  if name not in REGISTRY:
    raise KeyError(
      f'unknown algorithm {name!r}; choose one of {", ".join(REGISTRY)}'
    )
  return REGISTRY[name]


def model_for(name: str, model: model_lib.Model, hp: Any) -> model_lib.Model:
  """The network algorithm `name` (hyper-parameters `hp`) trains, built
  from the zoo model `model`."""
  wrap = get(name).model
  return model if wrap is None else wrap(model, hp)


def flag_name(name: str, field: dataclasses.Field) -> str:
  """The flag of hyper-parameter `field` of algorithm `name`."""
  prefix = get(name).prefix or name
  return field.metadata.get('flag') or f'{prefix}_{field.name}'


def flags_of(name: str) -> dict[str, dataclasses.Field]:
  """{flag name: field} of algorithm `name`'s hyper-parameters."""
  return {flag_name(name, f): f for f in dataclasses.fields(get(name).hparams)}


def all_flags() -> dict[str, tuple[dataclasses.Field, tuple[str, ...]]]:
  """{flag: (field, the algorithms that read it)} over the registry.

  Raises:
    ValueError: two algorithms define one flag with different defaults or
      types (a registry bug).
  """
  out: dict[str, tuple[dataclasses.Field, tuple[str, ...]]] = {}
  for name in REGISTRY:
    for flag, f in flags_of(name).items():
      if flag in out:
        first, users = out[flag]
        if (first.default, first.type) != (f.default, f.type):
          raise ValueError(
            f'field `{flag}` is defined twice, differently ({users[0]} and '
            f'{name})'
          )
        out[flag] = (first, users + (name,))
      else:
        out[flag] = (f, (name,))
  return out


def hparams(name: str, values: Mapping[str, Any]) -> Any:
  """Algorithm `name`'s hyper-parameters from flag values (missing flags
  take their defaults)."""
  fields = flags_of(name)
  return get(name).hparams(
    **{f.name: values[flag] for flag, f in fields.items() if flag in values}
  )


def display_name(variant: str) -> str:
  """The name of an algorithm or of one of its named variants in figures.

  An algorithm gives its label ('fedmr' -> 'FedMR'); a variant of an entry
  gives the label and the flags it overrides without their prefix
  ('fedmr_2stage20' -> 'FedMR (first_stage=20)'); any other name (a custom
  variant of `experiments.compare`) is returned as it is.
  """
  if variant in REGISTRY:
    return REGISTRY[variant].label
  for name, entry in REGISTRY.items():
    if variant in entry.variant_labels:
      return entry.variant_labels[variant]
    if variant in entry.variants:
      prefix = f'{entry.prefix or name}_'
      changes = ', '.join(
        f'{flag.removeprefix(prefix)}={value:g}'
        if isinstance(value, float)
        else f'{flag.removeprefix(prefix)}={value}'
        for flag, value in entry.variants[variant].items()
      )
      return f'{entry.label} ({changes})'
  return variant


def variants() -> dict[str, dict[str, Any]]:
  """compare's named variants: each algorithm by its name, and the
  entries' own variants (config overrides)."""
  out: dict[str, dict[str, Any]] = {}
  for name, entry in REGISTRY.items():
    out[name] = {'algorithm': name}
    for variant, overrides in entry.variants.items():
      out[variant] = {'algorithm': name, **overrides}
  return out
