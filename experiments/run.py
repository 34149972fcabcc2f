r"""Runs one federated training experiment.

  python -m experiments.run --flagfile=experiments/configs/default.flags
  python -m experiments.run --partition=iid --rounds=20 --workdir=/tmp/iid

Every flag is a field of `fedjax_mr.training.config.ExperimentConfig`;
`--helpfull` lists them. Re-running with the same `--workdir` resumes.
"""

from __future__ import annotations

import dataclasses
import sys

from absl import app
from absl import flags
from absl import logging

from fedjax_mr.core import errors
from fedjax_mr.training import config as config_lib


def _define_flags() -> None:
  for f in dataclasses.fields(config_lib.ExperimentConfig):
    help_text = f.metadata['help']
    allowed = config_lib.choices(f)
    if allowed:
      # Validated by config_lib.validate, for one clear error message.
      help_text += f' One of: {", ".join(allowed)}.'
    if f.type in ('bool', bool):
      flags.DEFINE_bool(f.name, f.default, help_text)
    elif f.type in ('int', int):
      flags.DEFINE_integer(f.name, f.default, help_text)
    elif f.type in ('float', float):
      flags.DEFINE_float(f.name, f.default, help_text)
    else:
      flags.DEFINE_string(f.name, f.default, help_text)


_define_flags()
FLAGS = flags.FLAGS


def config_from_flags() -> config_lib.ExperimentConfig:
  return config_lib.ExperimentConfig(
    **{
      f.name: getattr(FLAGS, f.name)
      for f in dataclasses.fields(config_lib.ExperimentConfig)
    }
  )


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  from fedjax_mr.training import distributed
  from fedjax_mr.training import experiment

  try:
    config = config_from_flags()
    # Before any JAX computation: host devices and the distributed runtime.
    distributed.initialize_for(config)
    experiment.train_and_evaluate(config)
  except (errors.UserError, errors.NonFiniteError) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2 if isinstance(e, errors.UserError) else 3)
  except KeyboardInterrupt:
    print(
      'interrupted; re-run with the same --workdir to resume', file=sys.stderr
    )
    sys.exit(130)


if __name__ == '__main__':
  app.run(main)
