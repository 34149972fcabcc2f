r"""Runs several algorithm variants × seeds on one setting; tabulates them.

  python -m experiments.compare --flagfile=experiments/configs/default.flags
  python -m experiments.compare \
      --flagfile=experiments/configs/fmnist_table.flags \
      --variants=fedavg,fedmr,indep,fedmr_p2,fedmr_2stage20,fedmut \
      --seeds=0,1,2 --workdir=runs/table/dir0.1

Every flag of `experiments.run` sets the common config, but `--workdir`
is the folder of the whole comparison: each run goes to
`<workdir>/<variant>/s<seed>`. `--variants` names
entries of `fedjax_mr.analysis.compare.VARIANTS`; `--variant=name:field=
value,...` (repeatable) defines another, e.g.
`--variant=mr_module:algorithm=fedmr,fedmr_grouping=module`. Re-running
resumes; `--summarize_only` just re-reads the metrics. Writes
`<workdir>/results.md` (final accuracy = mean test accuracy of the last --last
evaluations; mean ± std over seeds), `<workdir>/results.json` and
`<workdir>/curves.png` (the seed-averaged curves of every variant in one
figure).
"""

from __future__ import annotations

# First: Ctrl-C while the modules below import ends in one line (cli).
from . import cli  # isort: split

import functools

from absl import flags
from absl import logging

from fedjax_mr.core import errors
from fedjax_mr.pipeline import registry

from . import run as run_flags  # defines the experiment flags

flags.adopt_module_key_flags(run_flags)

_VARIANTS = flags.DEFINE_list(
  'variants',
  ['fedavg', 'fedmr'],
  'Named variants to run, comma-separated. Named variants: '
  + '; '.join(
    name
    + (
      ' (' + ', '.join(f'{k}={v}' for k, v in spec.items()) + ')'
      if set(spec) != {'algorithm'}
      else ''
    )
    for name, spec in registry.variants().items()
  )
  + '.',
)
_VARIANT = flags.DEFINE_multi_string(
  'variant',
  [],
  'A custom variant name:field=value,... (repeatable); runs after --variants.',
)
_SEEDS = flags.DEFINE_list('seeds', ['0'], 'Seeds, comma-separated.')
DEFAULT_WORKDIR = 'runs/compare'
flags.FLAGS['workdir'].help = (
  'Folder of the comparison: each run in <workdir>/<variant>/s<seed>, the '
  f'table and curves beside them. Default: {DEFAULT_WORKDIR}.'
)
# The flag's name before it was unified with the other programs'.
flags.DEFINE_alias('out', 'workdir')
_LAST = flags.DEFINE_integer(
  'last', 10, 'Final accuracy: mean over this many last evaluations.'
)
_SUMMARIZE_ONLY = flags.DEFINE_bool(
  'summarize_only', False, 'Only re-read the finished runs and tabulate.'
)
_TABLE = flags.DEFINE_enum(
  'table',
  'all',
  ['all', 'these'],
  'What results.md, results.json and curves.png cover: all, every run in '
  '--workdir (those of this command first), or these, the variants and '
  'seeds of this command only.',
)
# `--help`: the comparison's own flags, then experiments.run's by concern.
cli.set_help_groups(
  __name__,
  [
    (
      'Comparison',
      ['variants', 'variant', 'seeds', 'last', 'summarize_only', 'table'],
    ),
    *run_flags.HELP_GROUPS,
  ],
)


def main(argv) -> None:
  cli.no_arguments(argv)
  logging.set_verbosity(logging.WARNING)
  from fedjax_mr.analysis import compare
  from fedjax_mr.core import workdir as workdir_lib
  from fedjax_mr.pipeline import experiment
  from fedjax_mr.pipeline import records
  from fedjax_mr.runtime import distributed
  from fedjax_mr.runtime import provenance

  started = provenance.collect(with_devices=False)  # results.json's
  with cli.training_errors('re-run the same command to resume'):
    try:
      seeds = [int(s) for s in _SEEDS.value]
    except ValueError:
      raise errors.ConfigError(
        f'--seeds: integers, comma-separated; got {",".join(_SEEDS.value)}'
      ) from None
    if _LAST.value < 1:
      raise errors.ConfigError(f'--last must be >= 1, got {_LAST.value}')
    out = flags.FLAGS.workdir or DEFAULT_WORKDIR
    variants = [compare.parse_variant(v) for v in _VARIANTS.value]
    variants += [compare.parse_variant(v) for v in _VARIANT.value]
    if not variants or not seeds:
      raise errors.ConfigError('--variants and --seeds must not be empty')
    workdir_lib.check_usable(out)
    base = run_flags.flag_values()
    runs = compare.configs(base, variants, seeds, out)
    title = records.setting_title(compare.base_config(base))
    if not _SUMMARIZE_ONLY.value:
      first = runs[0][2]
      distributed.initialize_for(first.devices, first.server.clients_per_round)
      train = functools.partial(experiment.train_and_evaluate, log=cli.log)
      compare.run_matrix(runs, train, log=cli.log)
    names = [name for name, _ in variants]
    if _TABLE.value == 'these':
      summary = compare.summarize(
        out, names, seeds, last=_LAST.value, title=title, started=started
      )
    else:
      summary = compare.summarize(
        out, last=_LAST.value, title=title, first=names, started=started
      )
    print(compare.table(summary, title=title))
    print(f'curves: {out}/{compare.CURVES_FILE}')


def entry() -> None:
  """The console script `fedjax-mr-compare`."""
  cli.run(main)


if __name__ == '__main__':
  entry()
