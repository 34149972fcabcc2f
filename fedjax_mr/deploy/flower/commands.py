"""Flower's command lines, as the federation writes them and reads what
they print: options (`options`), node and run configs (`config_pairs`),
the lines of `flwr run`'s stream (`own_line`, `STARTED`, `RunLog`), and
the run's result where the ServerApp cannot write its file
(`result_line`, `read_result`).
"""

from __future__ import annotations

import json
import re
from typing import Callable
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


# The line a ServerApp prints its result as when it cannot write the
# result file (a full disk): the stream carries it to the launcher.
RESULT_MARK = 'fedjax_mr result: '


def result_line(result: dict) -> str:
  """`result` (JSON) as the line `read_result` reads back."""
  return RESULT_MARK + json.dumps(result)


def read_result(line: str) -> dict | None:
  """The result a `result_line` holds; None for any other line."""
  text = line.strip()
  if not text.startswith(RESULT_MARK):
    return None
  try:
    result = json.loads(text[len(RESULT_MARK) :])
  except ValueError:
    return None
  return result if isinstance(result, dict) else None


def own_line(line: str) -> bool:
  """Whether a line of `flwr run`'s stream is the App's own (not one of
  Flower's log lines, coloured or plain, nor its notices)."""
  text = line.strip()
  return (
    bool(text)
    and '\x1b[' not in line
    and not text.startswith(FLWR_LINES)
    and not FLWR_LOGGER.match(text)
    and not text.startswith(RESULT_MARK)
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


class RunLog:
  """The run's log file `out` and the terminal's `echo`; a log that can no
  longer be written (a full disk) is said once and the run goes on."""

  def __init__(self, out, echo: Callable[[str], None] | None):
    self._out = out
    self._echo = echo

  def keep(self, line: str) -> None:
    if self._out is None:
      return
    try:
      self._out.write(line)
      self._out.flush()
    except OSError as e:
      self.echo(
        f'warning: cannot write {self._out.name}: {e.strerror or e}; the '
        "rest of this run's Flower log is not kept"
      )
      try:  # what is left in its buffer would fail again at the end
        self._out.close()
      except OSError:
        pass
      self._out = None

  def echo(self, line: str) -> None:
    if self._echo is not None:
      self._echo(line)
