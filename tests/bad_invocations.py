"""Runs one program's `main` on many argument lists in one process.

  python -m tests.bad_invocations experiments.run '[["--seed=-1"], ...]'

prints a JSON list of {argv, code, stderr, wrote}: the exit code (or
'traceback' for an escaped exception), what went to stderr, and whether
the invocation created the scratch folder that every case's output flags
point at. Flags are reset to their defaults between cases.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import shutil
import sys
import traceback

from absl import flags


def main() -> None:
  module_name, cases, scratch = (
    sys.argv[1],
    json.loads(sys.argv[2]),
    sys.argv[3],
  )
  module = importlib.import_module(module_name)
  from experiments import cli

  results = []
  for argv in cases:
    flags.FLAGS.unparse_flags()
    shutil.rmtree(scratch, ignore_errors=True)
    err, out = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
      try:
        args = cli.parse_flags([module_name, *argv])
        code = cli.guarded(module.main)(args) or 0
      except SystemExit as e:
        code = e.code
      except BaseException:  # noqa: BLE001 - reported, the test fails on it
        code = 'traceback'
        traceback.print_exc(file=err)
    results.append(
      {
        'argv': argv,
        'code': code,
        'stderr': err.getvalue(),
        'wrote': os.path.exists(scratch),
      }
    )
  print(json.dumps(results))


if __name__ == '__main__':
  main()
