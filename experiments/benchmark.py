r"""Benchmarks a federated round against the hardware limit.

  python -m experiments.benchmark                 # default setting
  python -m experiments.benchmark --matrix        # devices × sizes
  python -m experiments.benchmark --num_clients=10000 --clients_per_round=1000
  python -m experiments.benchmark --algorithm=scaffold   # against FedAvg
  python -m experiments.benchmark --dataset=synthetic --model=logistic \
    --num_clients=1000000 --clients_per_round=10000 --local_epochs=1

Prints, for each setting, compile time, seconds per round against the
*limit* (centralised training of the same steps, one jitted loop), the
ratio, samples/s, GFLOP/s, the server and evaluation shares and, with
PyTorch installed (the `bench` extra), the round time of a plain PyTorch
FedAvg loop on the same clients (`experiments.torch_reference`, --threads
threads); then device speed-ups, peak memory, the matmul peaks, the
per-client overhead and the first setting's `evaluation share`,
`round/fedavg ratio` (with --algorithm), `round/pytorch ratio` and
`round/limit ratio`. `fedjax_mr.bench.measure` says what each figure is
and how it is timed. The flags are the fields of `fedjax_mr.bench.Setting`;
--dataset=synthetic takes Synthetic's --synthetic_alpha and
--synthetic_beta, and --algorithm its hyper-parameter flags, as
`experiments.run`.
"""

from __future__ import annotations

# First: Ctrl-C while the modules below import ends in one line (cli).
from . import cli  # isort: split

import os

from absl import flags

from fedjax_mr import bench
from fedjax_mr.core import errors

_DEFINE = {
  'bool': flags.DEFINE_bool,
  'int': flags.DEFINE_integer,
  'float': flags.DEFINE_float,
  'str': flags.DEFINE_string,
}
for _f in bench.flag_fields():
  if bench.choices(_f):
    flags.DEFINE_enum(
      _f.name, _f.default, bench.choices(_f), _f.metadata['help']
    )
  elif _f.name == 'client_chunks':
    flags.DEFINE_list(_f.name, [], _f.metadata['help'])
  else:
    _DEFINE[_f.type](_f.name, _f.default, _f.metadata['help'])
DATASET_FLAGS = [f.name for f in bench.dataset_fields()]
for _f in bench.dataset_fields():
  cli.define_flag(_f.name, _f, _f.metadata['help'])
ALGORITHM_FLAGS = cli.define_algorithm_flags()
FLAGS = flags.FLAGS


def _setting(values: dict, options: dict, chunks: list[str]) -> bench.Setting:
  """The setting of the flags' `values` ({name: value} of the setting's
  fields and the dataset's), the algorithm's `options` and
  `client_chunks`' counts `chunks`."""
  for c in chunks:
    if not c.isdigit():
      cli.fail(f'--client_chunks takes counts ≥ 0, got {c!r}')
  fields = {f.name for f in bench.flag_fields()} - {'client_chunks'}
  return bench.Setting(
    **{k: v for k, v in values.items() if k in fields},
    client_chunks=tuple(int(c) for c in chunks),
    dataset_options={k: values[k] for k in DATASET_FLAGS},
    algorithm_options=options,
  )


def _torch_loop() -> bench.TorchLoopFactory | None:
  """The PyTorch loop's maker, None without PyTorch (the bench extra)."""
  try:
    from . import torch_reference
  except ImportError:
    return None
  return torch_reference.bench_loop


def main(argv):
  cli.no_arguments(argv)
  setting = _setting(
    {name: FLAGS[name].value for name in FLAGS},
    cli.algorithm_options(ALGORITHM_FLAGS),
    FLAGS.client_chunks,
  )
  try:
    bench.check(setting)  # first, as measure would: its errors come first
    for name in ('sizes', 'alpha'):
      if bench.synthetic(setting) and FLAGS[name].present:
        cli.fail(
          f'--{name} sets the shares of a stored dataset; '
          '--dataset=synthetic clients have their own lognormal sizes'
        )
    torch_loop = _torch_loop() if setting.pytorch else None
    bench.measure(setting, torch_loop=torch_loop, log=cli.log)
  except errors.UserError as e:
    cli.fail(str(e))


def entry() -> None:
  """The console script `fedjax-mr-benchmark`."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  cli.run(main)


if __name__ == '__main__':
  entry()
