r"""The 2-D loss landscape around a finished run's global model.

  python -m experiments.landscape --workdir=runs/table/dir0.1/fedprox/s0 \
      --output=/tmp/landscape_fedprox
  python -m experiments.landscape --workdir=runs/fedmr --steps=31 \
      --extent=0.5 --num_examples=0 --split=train

Reads the run (its config.json and its newest checkpoint, or --round's)
without changing its records (the output goes to --output, by default a
new `landscape` folder inside the run's), draws two random directions
normalised filter by filter (Li et al., NeurIPS 2018) from --seed, and
evaluates the loss and accuracy of w + a·d1 + b·d2 on a --steps ×
--steps grid of (a, b) in [-extent, extent]², on --num_examples examples
of the --split (a seeded subset; 0: all). Writes
`<output>/landscape.json` (the grid) and `<output>/landscape.png`
(contours of the loss and the accuracy, the model at the centre). The
output folder is locked while the program runs.
"""

from __future__ import annotations

# First: Ctrl-C while the modules below import ends in one line (cli).
from . import cli  # isort: split

import os

from absl import flags
from absl import logging

from fedjax_mr.core import errors

_WORKDIR = flags.DEFINE_string(
  'workdir', None, 'The finished run (its folder, as given to experiments.run).'
)
_ROUND = flags.DEFINE_integer(
  'round', 0, "The checkpoint's round (0: the newest that restores)."
)
_OUTPUT = flags.DEFINE_string(
  'output',
  '',
  'Folder for landscape.json and .png; default <workdir>/landscape.',
)
_STEPS = flags.DEFINE_integer(
  'steps', 21, 'Grid points per axis (odd: the model is the middle one).'
)
_EXTENT = flags.DEFINE_float(
  'extent', 1.0, 'Coordinates along each direction run from -extent to extent.'
)
_NUM_EXAMPLES = flags.DEFINE_integer(
  'num_examples', 2000, 'Examples the loss is computed on (0: all of --split).'
)
# Checked with the other arguments (`landscape.check_args`).
_SPLIT = flags.DEFINE_string(
  'split', 'test', 'The examples: test or train (the training split).'
)
_SEED = flags.DEFINE_integer(
  'seed', 0, 'Seed of the two directions and of the subset of examples.'
)
_POINTS_PER_PASS = flags.DEFINE_integer(
  'points_per_pass',
  1,
  'Grid points evaluated at once (vmapped): 1 is the fastest on CPU; more '
  'keep an accelerator busy with a small model, at that many times the '
  'memory.',
)

JSON_FILE = 'landscape.json'
PNG_FILE = 'landscape.png'


def main(argv) -> None:
  cli.no_arguments(argv)
  logging.set_verbosity(logging.WARNING)
  from fedjax_mr.analysis import landscape
  from fedjax_mr.core import workdir as workdir_lib
  from fedjax_mr.pipeline import experiment
  from fedjax_mr.pipeline import records
  from fedjax_mr.pipeline import registry
  from fedjax_mr.runtime import metrics_io
  from fedjax_mr.runtime import plots

  landscape.check_args(
    steps=_STEPS.value,
    extent=_EXTENT.value,
    num_examples=_NUM_EXAMPLES.value,
    split=_SPLIT.value,
    seed=_SEED.value,
    points_per_pass=_POINTS_PER_PASS.value,
  )
  if _ROUND.value < 0:
    raise errors.ConfigError(f'--round must be >= 0, got {_ROUND.value}')
  workdir = _WORKDIR.value
  if not workdir:
    raise errors.ConfigError('--workdir: the finished run to read is required')
  if not os.path.isdir(workdir):
    raise errors.ConfigError(f'--workdir={workdir}: no such folder')
  output = _OUTPUT.value or os.path.join(workdir, 'landscape')
  workdir_lib.check_free(output, 'output')
  run = experiment.load_run(workdir, _ROUND.value or None)
  data = landscape.examples(
    run.config, _SPLIT.value, _NUM_EXAMPLES.value, _SEED.value
  )
  with workdir_lib.acquire(output, 'output'):
    grid = landscape.compute(
      run,
      data,
      steps=_STEPS.value,
      extent=_EXTENT.value,
      seed=_SEED.value,
      points_per_pass=_POINTS_PER_PASS.value,
    )
    name = registry.display_name(run.config.algorithm.name)
    grid = {
      'workdir': os.path.abspath(workdir),
      'algorithm': run.config.algorithm.name,
      'setting': records.setting_title(run.config),
      'split': _SPLIT.value,
      **grid,
    }
    metrics_io.write_json(os.path.join(output, JSON_FILE), grid, indent=1)
    plots.plot_landscape(
      grid,
      os.path.join(output, PNG_FILE),
      title=(
        f'{name}, round {grid["round"]}: {grid["setting"]}\n'
        f'{_SPLIT.value} loss on {grid["num_examples"]:,} examples along two '
        f'filter-normalised random directions (seed {_SEED.value})'
      ),
    )
  loss, accuracy = grid['center']['loss'], grid['center']['accuracy']
  print(
    f'{name} at round {grid["round"]}, at the centre: {_SPLIT.value} loss '
    + ('non-finite' if loss is None else f'{loss:.4f}')
    + ('' if accuracy is None else f', accuracy {100 * accuracy:.2f} %')
    + f'; grid {_STEPS.value}×{_STEPS.value} over ±{_EXTENT.value:g}'
  )
  print(f'wrote {os.path.join(output, PNG_FILE)} and {JSON_FILE}')


def entry() -> None:
  """The console script `fedjax-mr-landscape`."""
  cli.run(main)


if __name__ == '__main__':
  entry()
