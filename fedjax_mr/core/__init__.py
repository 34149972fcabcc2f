"""Interfaces and tree helpers shared by every algorithm.

Loaded lazily: `fedjax_mr.core.errors`, `files`, `jsonfile`, `workdir`
and `config_tree` are plain Python, and the host-only parts of the library
(the energy module) use them without importing JAX; `tree`, `types` and
the interface names below import it on first use.
"""

import importlib
from typing import Any

_SUBMODULES = ('tree', 'types')
_TYPE_NAMES = (
  'Algorithm',
  'ClientOutput',
  'ClientUpdate',
  'Dispatch',
  'Variables',
)
__all__ = [*_SUBMODULES, *_TYPE_NAMES]


def __getattr__(name: str) -> Any:
  if name in _SUBMODULES:
    return importlib.import_module(f'{__name__}.{name}')
  if name in _TYPE_NAMES:
    return getattr(importlib.import_module(f'{__name__}.types'), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__() -> list[str]:
  return sorted([*globals(), *__all__])
