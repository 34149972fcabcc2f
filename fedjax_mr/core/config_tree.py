"""A config as a tree of frozen dataclasses whose fields have flat names.

A config (`fedjax_mr.pipeline.config.ExperimentConfig`,
`fedjax_mr.pipeline.stitch_config.StitchConfig`) is a frozen dataclass of
parts (`part`), one per concern; a part holds fields (`field`) and maybe
parts of its own. Each field has a flat name, unique in the tree: its
`flag` metadata, else its own name. The programs' flags, config.json and
the tests speak in those names; `fields` lists them in the tree's order,
`flat` reads a config by them and `replaced` builds one from them. A part
shared by several configs is defined once and composed by each (a config
whose own part differs subclasses it, a flat config takes its fields by
`shared`); where a default differs, its help says why. Plain
Python: nothing here reads a file or imports jax.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Mapping
from typing import NamedTuple


def field(
  default: Any,
  help_text: str,
  *,
  choices: Any = None,
  run_only: bool = False,
  flag: str | None = None,
) -> Any:
  """A config field: its default, help text, allowed values, whether it
  may change when a run resumes (`run_only`), and its flat name where
  that is not its own."""
  metadata = {'help': help_text, 'choices': choices, 'run_only': run_only}
  if flag:
    metadata['flag'] = flag
  return dataclasses.field(default=default, metadata=metadata)


def shared(
  kind: type,
  name: str,
  *,
  default: Any = dataclasses.MISSING,
  choices: Any = None,
  why: str = '',
) -> Any:
  """Field `name` of the part `kind`, defined there once, in another
  config (a subclass of the part, or a flat config such as the
  benchmark's): the same default, help, choices and flat name; or another
  `default` or fewer `choices`, whose reason `why` ends the help.

  Raises:
    ValueError: `kind` has no field `name`; another default or choices
      without `why`.
  """
  found = {f.name: f for f in dataclasses.fields(kind)}.get(name)
  if found is None:
    raise ValueError(f'name: {kind.__name__} has no field {name!r}')
  metadata = dict(found.metadata)
  changed = []
  if default is not dataclasses.MISSING:
    changed.append(f'default {default!r}')
  else:
    default = found.default
  if choices is not None:
    changed.append(f'only {", ".join(choices)}')
    metadata['choices'] = tuple(choices)
  if changed and not why:
    raise ValueError(f'why: {" and ".join(changed)} of {name!r} need a reason')
  if changed:
    metadata['help'] = f'{metadata["help"]} Here {" and ".join(changed)}: {why}'
  return dataclasses.field(default=default, metadata=metadata)


def part(kind: type) -> Any:
  """A field that holds a part of the tree (`kind`, at its defaults)."""
  return dataclasses.field(default_factory=kind, metadata={'part': True})


class FlagField(NamedTuple):
  """A field of the config tree under its flat name.

  Attributes:
    name: the flat name ('partition_file').
    path: the attributes that reach it (('partition', 'file')).
    field: the dataclass field.
  """

  name: str
  path: tuple[str, ...]
  field: dataclasses.Field

  @property
  def default(self) -> Any:
    return self.field.default

  @property
  def type(self) -> Any:
    return self.field.type

  @property
  def metadata(self) -> Mapping[str, Any]:
    return self.field.metadata


def fields(kind: type, path: tuple[str, ...] = ()) -> tuple[FlagField, ...]:
  """Every field of the tree of `kind`, part by part, in order (a part
  without a default factory, filled otherwise, is left out)."""
  out = []
  for f in dataclasses.fields(kind):
    if f.metadata.get('part'):
      if f.default_factory is not dataclasses.MISSING:
        out += fields(f.default_factory, (*path, f.name))
      continue
    out.append(FlagField(f.metadata.get('flag', f.name), (*path, f.name), f))
  return tuple(out)


def get(config: Any, path: tuple[str, ...]) -> Any:
  """The value at `path` in `config`."""
  for name in path:
    config = getattr(config, name)
  return config


def flat(config: Any, tree_fields: tuple[FlagField, ...]) -> dict[str, Any]:
  """{flat name: value} of `tree_fields` in `config`."""
  return {f.name: get(config, f.path) for f in tree_fields}


def _set(node: Any, path: tuple[str, ...], value: Any) -> Any:
  """`node` with the field at `path` replaced (a new tree)."""
  if not path:
    return value
  child = _set(getattr(node, path[0]), path[1:], value)
  return dataclasses.replace(node, **{path[0]: child})


def replaced(
  base: Any, by_name: Mapping[str, FlagField], values: Mapping[str, Any]
) -> Any:
  """`base` with the fields of `values` ({flat name: value}, each a key of
  `by_name`) replaced; each part changed is built once, with all its new
  values (its `__post_init__` sees them together)."""
  by_part: dict[tuple[str, ...], dict[str, Any]] = {}
  for name, value in values.items():
    path = by_name[name].path
    by_part.setdefault(path[:-1], {})[path[-1]] = value
  # Deepest parts first, so a part is replaced after its own parts.
  config = base
  for parent in sorted(by_part, key=len, reverse=True):
    node = dataclasses.replace(get(config, parent), **by_part[parent])
    config = _set(config, parent, node)
  return config


def check_names(kind: type, names: Any, known: Any) -> None:
  """Raises `TypeError` (as a dataclass does) for the first of `names`
  not in `known`."""
  unknown = sorted(set(names) - set(known))
  if unknown:
    raise TypeError(
      f'{kind.__name__} got an unexpected keyword argument {unknown[0]!r}'
    )
