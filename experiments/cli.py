"""What every program of `experiments/` does with bad input: one line.

`run(main)` replaces `absl.app.run(main)`: a flag that does not parse (an
unknown flag, `--rounds=abc`, a missing flagfile) and `fail(...)` both print
`error: <message>` on stderr as a single line and exit with code 2 — no
usage text, no traceback.
"""

from __future__ import annotations

import sys
from typing import Callable
from typing import NoReturn

from absl import app
from absl import flags

EXIT_USAGE = 2


def fail(message: str) -> NoReturn:
  """Prints `error: message` (one line) on stderr and exits with code 2."""
  line = ' '.join(str(message).split())  # one line, whatever it holds
  print(f'error: {line}', file=sys.stderr)
  sys.exit(EXIT_USAGE)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with parse errors as one line."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(str(e))


def no_arguments(argv: list[str]) -> None:
  """Refuses positional arguments (every program takes flags only)."""
  if len(argv) > 1:
    fail(f'unexpected arguments: {" ".join(argv[1:])} (flags are --name=value)')


def run(main: Callable[[list[str]], object]) -> None:
  """`absl.app.run(main)` with one-line errors for unparsable flags."""
  app.run(main, flags_parser=parse_flags)
