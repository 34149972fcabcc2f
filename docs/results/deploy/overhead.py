"""The round time of a deployed run against the simulated one, at the
default setting (experiments/configs/default.flags: Fashion-MNIST,
cnn_mnist, 100 clients, K = 10), on 2 and on 5 local SuperNodes.

  cd docs/results/deploy
  python overhead.py > overhead_warm.json
  python overhead.py --cold > overhead.json

Runs the setting `--rounds` times (4 unless given) with `experiments.run`'s
pipeline (`experiment.train_and_evaluate`, at the setting's own devices
and chunks) and deployed with `launch.run` on a local federation (a
SuperLink and N SuperNodes as processes, TLS and node authentication) of
each `--nodes` (2,5 unless given), each in a fresh workdir (the nodes'
App processes forked from warm SuperExecs, `fedjax_mr.deploy.flower.warm`;
`--cold`: Flower's own launcher, a fresh process for every message; the
record's `launcher`), and reads each
round's `round_time_s` from the runs' metrics rows (the host loop's clock,
after `block_until_ready`; evaluation is timed apart and not included).
The first round compiles (and, deployed, starts every node's first
`flwr-clientapp` process cold), so the medians are of the rounds after it
(steady state). The transport's overhead per round is the deployed median
minus the simulated one, in ms and as a percentage of the simulated one.
The record names the machine (lscpu's model name), the commit, the
setting and the load average before and after (a number taken on a
loaded machine says so).

`key=value` arguments replace the setting's values (a quick check of the
script: `dataset=synthetic model=logistic num_clients=10 local_epochs=1
--rounds=2 --nodes=2`); the record then says so in its `setting`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from fedjax_mr.deploy import launch
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import experiment

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
  os.path.abspath(__file__)))))  # fmt: skip
DEFAULT = dict(
  dataset='fashion_mnist',
  model='cnn_mnist',
  num_clients=100,
  clients_per_round=10,
  partition='dirichlet',
  alpha=0.1,
  local_epochs=5,
  batch_size=50,
  lr=0.01,
  momentum=0.9,
  seed=0,
)


def _machine() -> str:
  out = subprocess.run(['lscpu'], capture_output=True, text=True).stdout
  for line in out.splitlines():
    if line.startswith('Model name:'):
      return line.split(':', 1)[1].strip()
  return 'unknown'


def _commit() -> str:
  def git(*args):
    return subprocess.run(
      ['git', '-C', REPO, *args], capture_output=True, text=True
    ).stdout.strip()

  dirty = git('status', '--porcelain', '--untracked-files=no')
  return git('rev-parse', '--short', 'HEAD') + ('-dirty' if dirty else '')


def _value(text: str):
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def round_times(workdir: str) -> list[float]:
  """Each round's `round_time_s` in a run's metrics rows."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [float(json.loads(line)['round_time_s']) for line in f]


def summary(times: list[float]) -> dict:
  """The rounds' times and the median of those after the first."""
  steady = times[1:] or times
  return {'round_times_s': times, 'median_s': statistics.median(steady)}


def measure(
  setting: dict,
  rounds: int,
  nodes: list[int],
  folder: str,
  warm: bool = True,
):
  """The record: the simulated run, then one deployed run per `nodes`."""
  flat = {**setting, 'rounds': rounds, 'eval_every': rounds}

  def config(name, **values):
    workdir = os.path.join(folder, name)
    return config_lib.ExperimentConfig.from_flat(
      **flat, **values, workdir=workdir
    ), workdir

  quiet = lambda line: None  # noqa: E731
  record = {
    'machine': _machine(),
    'cpus': os.cpu_count(),
    'commit': _commit(),
    'setting': flat,
    'launcher': 'warm' if warm else 'flower',
    'load_average_before': list(os.getloadavg()),
  }
  c, workdir = config('simulated')
  experiment.train_and_evaluate(c, workdir, log=quiet)
  simulated = summary(round_times(workdir))
  record['simulated'] = simulated
  record['deployed'] = []
  for n in nodes:
    # Deployed rounds sum one client at a time on one device, the order
    # the deployment's sums follow (docs/howto/deploy.md).
    c, workdir = config(f'deployed{n}', num_devices=1, client_chunk=1)
    launch.run(c, n, log=quiet, warm=warm)
    deployed = summary(round_times(workdir))
    over = deployed['median_s'] - simulated['median_s']
    record['deployed'].append(
      {
        'nodes': n,
        **deployed,
        'overhead_ms': 1000 * over,
        'overhead_pct': 100 * over / simulated['median_s'],
      }
    )
  record['load_average_after'] = list(os.getloadavg())
  return record


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--rounds', type=int, default=4)
  parser.add_argument('--nodes', default='2,5')
  parser.add_argument(
    '--cold', action='store_true', help="Flower's own launcher"
  )
  parser.add_argument('values', nargs='*', help='key=value setting changes')
  args = parser.parse_args(argv)
  setting = dict(DEFAULT)
  for item in args.values:
    key, _, value = item.partition('=')
    setting[key] = _value(value)
  nodes = [int(n) for n in args.nodes.split(',')]
  start = time.monotonic()
  with tempfile.TemporaryDirectory(prefix='deploy_overhead_') as folder:
    record = measure(setting, args.rounds, nodes, folder, not args.cold)
  record['wall_s'] = time.monotonic() - start
  print(json.dumps(record, indent=1))
  print(table_rows(record), file=sys.stderr)


def table_rows(record: dict) -> str:
  """The deploy page's table rows of `record` (for docs/howto/deploy.md,
  in place of the placeholder row; tests/deploy/test_overhead_record.py)."""
  sim = record['simulated']['median_s']
  return '\n'.join(
    f'| {d["nodes"]} | {sim:.2f} | {d["median_s"]:.2f} | '
    f'{d["overhead_ms"]:,.0f} | {d["overhead_pct"]:.1f} |'
    for d in record['deployed']
  )


if __name__ == '__main__':
  main(sys.argv[1:])
