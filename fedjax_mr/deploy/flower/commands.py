"""Flower's command lines, as the federation writes them and reads what
they print: options (`options`), node and run configs (`config_pairs`),
the lines of `flwr run`'s stream (`own_line`, `STARTED`).
"""

from __future__ import annotations

import re
from typing import Mapping

# What `flwr run` says once the SuperLink accepted the run.
STARTED = re.compile(r'Successfully started run (\d+)')


def _toml_value(value) -> str:
  if isinstance(value, bool):
    return 'true' if value else 'false'
  if isinstance(value, (int, float)):
    return repr(value)
  escaped = str(value).replace('\\', '\\\\').replace('"', '\\"')
  return f'"{escaped}"'


# What `flwr run` prints of its own, besides Flower's log lines.
FLWR_LINES = (
  'Using SuperLink',
  'Successfully',
  'Flower App configuration',
  '- Recommended',
)


# A line of Flower's logger in Python's plain format (the ServerApp
# process's, which `flwr run` relays in its stream): `DEBUG:flwr:...`.
FLWR_LOGGER = re.compile(r'(DEBUG|INFO|WARNING|ERROR|CRITICAL):flwr:')


def own_line(line: str) -> bool:
  """Whether a line of `flwr run`'s stream is the App's own (not one of
  Flower's log lines, coloured or plain, nor its notices)."""
  text = line.strip()
  return (
    bool(text)
    and '\x1b[' not in line
    and not text.startswith(FLWR_LINES)
    and not FLWR_LOGGER.match(text)
  )


def options(**values: object) -> list[str]:
  """Flower's command-line options for `values`: each name with two
  dashes and its underscores as hyphens, then its value (`True` alone:
  a switch; `None`: left out)."""
  args = []
  for name, value in values.items():
    if value is None:
      continue
    args.append('-' * 2 + name.replace('_', '-'))
    if value is not True:
      args.append(str(value))
  return args


def config_pairs(config: Mapping[str, object]) -> str:
  """`config` as Flower's space separated `key=value` pairs (TOML
  values)."""
  return ' '.join(f'{k}={_toml_value(v)}' for k, v in config.items())
