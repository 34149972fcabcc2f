"""The algorithms the experiment programs know, one line each.

An entry names the algorithm's hyper-parameter dataclass (each field is a
flag `--<prefix>_<field>`, or the field's `metadata['flag']`), its factory
`factory(setting, hparams) -> Algorithm`, its default aggregation weights
('examples' or 'uniform', what `--weighting=auto` means for it), whether it
keeps K different models (their accuracies are then evaluated too),
named variants for `experiments.compare`, optionally how it changes
the network the clients train (MOON's projection head), and its name in
figures and tables (`display_name`). The flags of
`experiments.run`, the list of `--algorithm` choices and compare's
variants are generated from here; adding an algorithm is one module and
one line below.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable
from typing import Mapping
from typing import NamedTuple

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
  """

  local: client.LocalTraining
  clients_per_round: int
  num_clients: int
  weighted: bool
  variables: types.Variables


class Entry(NamedTuple):
  """One algorithm of the registry (see the module docstring)."""

  hparams: type
  factory: Callable[[Setting, Any], types.Algorithm]
  weighting: str = 'examples'
  multi_model: bool = False
  prefix: str = ''
  variants: Mapping[str, Mapping[str, Any]] = {}
  # model(zoo model, hparams) -> the network the algorithm trains; None:
  # the zoo model unchanged.
  model: Callable[[model_lib.Model, Any], model_lib.Model] | None = None
  # The name in figures ('FedMR'); '' means the registry name.
  label: str = ''


# name: Entry(hparams, factory, weighting, multi_model, prefix, variants,
#             model, label)
# fmt: off
REGISTRY: dict[str, Entry] = {
  'fedavg': Entry(fedavg.Hparams, fedavg.build, label='FedAvg'),
  'fedprox': Entry(fedprox.Hparams, fedprox.build, label='FedProx'),
  'fedexp': Entry(fedexp.Hparams, fedexp.build, 'uniform', label='FedExP'),
  'fedasam': Entry(fedasam.Hparams, fedasam.build, label='FedASAM'),
  'fedsam': Entry(fedasam.SamHparams, fedasam.build_sam, label='FedSAM'),
  'fedgen': Entry(fedgen.Hparams, fedgen.build, 'examples', False, '', fedgen.VARIANTS, label='FedGen'),  # noqa: E501
  'clusamp': Entry(clusamp.Hparams, clusamp.build, 'uniform', False, '', clusamp.VARIANTS, label='CluSamp'),  # noqa: E501
  'moon': Entry(moon.Hparams, moon.build, 'examples', False, '', {}, moon.wrap_model, label='MOON'),  # noqa: E501
  'scaffold': Entry(scaffold.Hparams, scaffold.build, 'uniform', False, '', scaffold.VARIANTS, label='SCAFFOLD'),  # noqa: E501
  'fedmr': Entry(fedmr.Hparams, fedmr.build, 'uniform', True, '', fedmr.VARIANTS, label='FedMR'),  # noqa: E501
  'fedmr_p': Entry(fedmr.PHparams, fedmr.build_p, 'uniform', True, 'fedmr', fedmr.P_VARIANTS, label='FedMR-p'),  # noqa: E501
  'indep': Entry(fedmr.Hparams, fedmr.build_indep, 'uniform', True, 'fedmr', label='Indep'),  # noqa: E501
  'fedmut': Entry(fedmut.Hparams, fedmut.build, 'uniform', True, '', fedmut.VARIANTS, label='FedMut'),  # noqa: E501
  'depthfl': Entry(depthfl.Hparams, depthfl.build, 'examples', False, '', depthfl.VARIANTS, depthfl.wrap_model, label='DepthFL'),  # noqa: E501
  'heterofl': Entry(heterofl.Hparams, heterofl.build, 'uniform', label='HeteroFL'),  # noqa: E501
  'fedepth': Entry(fedepth.Hparams, fedepth.build, label='FeDepth'),
  'ft_full': Entry(finetune.Hparams, finetune.build_full, prefix='ft', label='FT-Full'),  # noqa: E501
  'ft_part': Entry(finetune.PartHparams, finetune.build_part, prefix='ft', label='FT-Part'),  # noqa: E501
}
# fmt: on


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
            f'flag --{flag} is defined twice, differently ({users[0]} and '
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
    return REGISTRY[variant].label or variant
  for name, entry in REGISTRY.items():
    if variant in entry.variants:
      prefix = f'{entry.prefix or name}_'
      changes = ', '.join(
        f'{flag.removeprefix(prefix)}={value:g}'
        if isinstance(value, float)
        else f'{flag.removeprefix(prefix)}={value}'
        for flag, value in entry.variants[variant].items()
      )
      return f'{entry.label or name} ({changes})'
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
