"""The benchmark and experiment programs print figures, reject bad input."""

import json
import re

import pytest

from tests import fork_server
from tests import helpers

# Each program in a process of its own, forked from one that imported the
# libraries once (tests/fork_server.py).
_run = fork_server.run_module
# The per-client overhead line: (round - limit) / K and its share.
_OVERHEAD = (
  r'^per-client overhead: -?[\d.]+(e[+-]\d+)? ms/client '
  r'\(-?\d+\.\d% of the round\)$'
)


def test_benchmark_prints_its_figures(small_fmnist_dir):
  # MOON (a network with a projection head, per-client state) timed with
  # FedAvg beside it; FedAvg alone runs the same code without the pair.
  proc = _run(
    'experiments.benchmark',
    '--algorithm=moon',
    f'--data_dir={small_fmnist_dir}',
    '--num_clients=8',
    '--clients_per_round=2',
    '--local_epochs=1',
    '--rounds=1',
    '--sizes=dirichlet',
    '--alpha=0.5',
  )
  assert proc.returncode == 0, proc.stderr
  out = proc.stdout
  m = re.search(
    r"round/limit ([\d.]+) \(([\d.]+) of the limit's samples/s\) \| "
    r'\d+ samples/s',
    out,
  )
  assert m and abs(float(m[1]) * float(m[2]) - 1) < 0.01
  assert re.search(r'\| state sha256 [0-9a-f]{16}$', out, re.M)
  assert re.search(r'server [\d.]+% of round', out)
  # MOON evaluates its one model: 1 model, once per 10 rounds by default.
  assert re.search(
    r'evaluation [\d.]+s \(1 model\(s\), \d+ test examples\), '
    r'[\d.]+% of 10 rounds',
    out,
  )
  assert re.search(
    r'^evaluation share: \d+\.\d% \(once per 10 rounds\)$', out, re.M
  )
  assert 'peak host memory' in out
  assert re.search(r'reaches \d+\.\d% of the float32 peak', out)
  try:
    import torch  # noqa: F401
  except ImportError:
    assert 'PyTorch reference: not installed' in out
  else:
    assert re.search(r'^round/pytorch ratio: \d+\.\d\d$', out, re.M)
  assert re.search(r'^round/limit ratio: \d+\.\d\d$', out, re.M)
  assert re.search(_OVERHEAD, out, re.M)
  assert re.search(r'fedavg [\d.]+s, per-step ratio [\d.]+', out)
  assert re.search(r'^round/fedavg ratio: \d+\.\d\d$', out, re.M)


def test_benchmark_evaluation_share_of_fedmr(small_fmnist_dir):
  # FedMR evaluates the global model and the K = 2 models it dispatches.
  # The clients are test_benchmark_prints_its_figures' (Dirichlet(0.5)), so
  # FedAvg's round beside FedMR is its compile read back from the cache;
  # no matmul peak (10 s of CPU; that test checks its line).
  proc = _run(
    'experiments.benchmark',
    '--algorithm=fedmr',
    f'--data_dir={small_fmnist_dir}',
    '--num_clients=8',
    '--clients_per_round=2',
    '--local_epochs=1',
    '--rounds=1',
    '--sizes=dirichlet',
    '--alpha=0.5',
    '--eval_every=4',
    '--nopytorch',
    '--nolimit',
    '--nopeak',
  )
  assert proc.returncode == 0, proc.stderr
  line = re.search(
    r'round ([\d.]+)s .* evaluation ([\d.]+)s \(3 model\(s\), \d+ test '
    r'examples\), ([\d.]+)% of 4 rounds',
    proc.stdout,
  )
  assert line, proc.stdout
  round_s, eval_s, pct = map(float, line.groups())
  assert pct == pytest.approx(100 * eval_s / (4 * round_s), rel=0.02, abs=0.1)
  assert re.search(
    r'^evaluation share: [\d.]+% \(once per 4 rounds\)$', proc.stdout, re.M
  )
  assert 'per-client overhead: not measured (--nolimit)' in proc.stdout


def test_benchmark_synthetic_prints_the_overhead():
  # Generated clients, Synthetic(α, β): the round, its limit (generating
  # its examples too) and the per-client overhead before the last lines;
  # the logistic regression is a tiny model, its 4 clients one vmapped chunk.
  # No matmul peak: its line comes before these (checked by
  # test_benchmark_prints_its_figures) and costs 10 s of CPU.
  proc = _run(
    'experiments.benchmark',
    '--dataset=synthetic',
    '--model=logistic',
    '--synthetic_alpha=0.5',
    '--num_clients=1000',
    '--clients_per_round=4',
    '--local_epochs=1',
    '--rounds=1',
    '--nopeak',
  )
  assert proc.returncode == 0, proc.stderr
  out = proc.stdout
  assert re.search(r'^Synthetic\(0\.5, 1\): 1000 clients generated', out, re.M)
  assert 'PyTorch reference: none for generated clients' in out
  line = re.search(
    r'^\[lognormal, 1 device\(s\), chunk 4\] .* round ([\d.]+)s '
    r'\((\d+) steps\) \| limit ([\d.]+)s',
    out,
    re.M,
  )
  assert line, out
  round_s, steps, limit_s = map(float, line.groups())
  assert round_s > 0 and limit_s > 0 and steps >= 4
  lines = out.splitlines()
  assert re.match(_OVERHEAD, lines[-3]), out
  assert lines[-2].startswith('evaluation share: ')
  assert re.match(r'round/limit ratio: \d+\.\d\d$', lines[-1])


def test_benchmark_times_a_batchnorm_model(small_fmnist_dir):
  # resnet20 keeps BatchNorm statistics beside its parameters: the limit's
  # step reads them as the clients do (it failed with
  # ScopeCollectionNotFound before). 32 clients of about 47 examples: a
  # few steps a round, since compiling resnet20 is what this costs. No
  # matmul peak (10 s of CPU; test_benchmark_prints_its_figures checks it).
  proc = _run(
    'experiments.benchmark',
    f'--data_dir={small_fmnist_dir}',
    '--model=resnet20',
    '--num_clients=32',
    '--clients_per_round=1',
    '--local_epochs=1',
    '--batch_size=8',
    '--rounds=1',
    '--nopytorch',
    '--nopeak',
  )
  assert proc.returncode == 0, proc.stderr
  assert re.search(r'^round/limit ratio: \d+\.\d\d$', proc.stdout, re.M)


def test_benchmark_rejects_bad_devices(small_fmnist_dir):
  proc = _run(
    'experiments.benchmark', f'--data_dir={small_fmnist_dir}', '--num_devices=7'
  )
  assert proc.returncode != 0
  assert '--num_devices=7' in proc.stderr and 'Traceback' not in proc.stderr


def test_zoo_report_tables():
  proc = _run(
    'experiments.zoo_report',
    '--models=cnn_femnist',
    '--datasets=fashion_mnist,femnist',
    '--repeats=1',
  )
  assert proc.returncode == 0, proc.stderr
  assert re.search(
    r'^\| cnn_femnist \| 28x28x1 \| 160,510 \| [\d.]+ \| ', proc.stdout, re.M
  )
  assert '| femnist | 805,263 | 602 | - | computed' in proc.stdout
  row = re.search(
    r'^\| fashion_mnist \| 60,000 \| (\d+) \| (\d+) \|', proc.stdout, re.M
  )
  assert row, proc.stdout  # measured, not "failed: ..."
  arrays, peak = map(int, row.groups())
  assert peak < 1.5 * arrays + 16  # the examples held about once, not twice
  bad = _run('experiments.zoo_report', '--models=alexnet')
  assert bad.returncode != 0 and "--models: unknown 'alexnet'" in bad.stderr


@pytest.mark.parametrize(
  'table, says', [('all', 'no runs there'), ('these', 'no runs of variants')]
)
def test_compare_summarize_only_without_runs_says_so(tmp_path, table, says):
  proc = _run(
    'experiments.compare',
    '--variants=fedavg,fedmr',
    '--seeds=0,1',
    f'--workdir={tmp_path}/nothing_here',
    f'--table={table}',
    '--summarize_only',
  )
  assert proc.returncode == 2
  assert 'Traceback' not in proc.stderr
  assert proc.stderr.startswith(
    f'error: --workdir={tmp_path}/nothing_here: {says}'
  )
  assert proc.stderr.rstrip().endswith('nothing to summarize')


def _programs():
  """The programs of experiments/ (those with a console script)."""
  import os

  folder = os.path.join(os.path.dirname(helpers.__file__), '..', 'experiments')
  return sorted(
    name[: -len('.py')]
    for name in os.listdir(folder)
    if name.endswith('.py')
    and 'def entry()' in open(os.path.join(folder, name)).read()
  )


def _docstring_start(program):
  import ast
  import os

  path = os.path.join(
    os.path.dirname(helpers.__file__), '..', 'experiments', program + '.py'
  )
  return ast.get_docstring(ast.parse(open(path).read())).split('\n')[0]


# The programs whose --help lists their flags by concern, as run's: a
# heading of each and its first flag.
_GROUPED = {
  'compare': ('Comparison', 'variants=fedavg,fedmr'),
  'deploy': ('Federation', 'nodes=2'),
  'deploy_stitch': ('Federation', 'nodes=2'),
  'stitch': ('Pool', 'pool=runs/pool'),
}
# The flags of a federation (experiments/deploy_flags.py's define_deploy_flags).
_DEPLOY_FLAGS = {
  'nodes',
  'round_timeout',
  'insecure_federation',
  'federation_host',
  'expose_federation',
  'flower_logs',
  'warm_superexec',
  'node_heartbeat_s',
  'superlink',
  'root_certificates',
  'operator_token',
  'node_ids',
}


@pytest.mark.parametrize(
  'program', [p for p in _programs() if p != 'run' and p not in _GROUPED]
)
def test_helpshort_prints_the_programs_description_and_own_flags(program):
  proc = _run(f'experiments.{program}', '--helpshort')
  assert proc.returncode == 0, proc.stderr
  out = proc.stdout
  assert out.startswith(_docstring_start(program))
  # The program's own flags under its heading, not absl's (--logtostderr).
  heading = re.search(rf'^\S*experiments/{program}\.py:$', out, re.M)
  assert heading and out[heading.end() :].startswith('\n  --'), out
  assert '--logtostderr' not in out and '--helpfull' in out


def test_run_help_lists_the_flags_by_concern_and_leaves_the_rest_to_helpfull():
  short = _run('experiments.run', '--helpshort')
  help_ = _run('experiments.run', '--help')
  full = _run('experiments.run', '--helpfull')
  assert short.returncode == help_.returncode == full.returncode == 0
  assert short.stdout == help_.stdout
  out = short.stdout
  assert out.startswith(_docstring_start('run'))
  # A heading per part of the config, its flags under it, a line each.
  for heading, first in [
    ('Data', 'dataset=fashion_mnist'),
    ('Partition', 'partition=dirichlet'),
    ('Local training', 'local_epochs=5'),
    ('Server', 'clients_per_round=10'),
    # The fields shared with every program's run part come first.
    ('Run and records', 'seed=0'),
    ('Processes (multi-host)', 'coordinator_address='),
  ]:
    assert f'\n{heading}:\n  --{first}  ' in out, heading
  from fedjax_mr.pipeline import config as config_lib

  listed = re.findall(r'^  --(\w+)=', out, re.M)
  assert sorted(listed) == sorted(f.name for f in config_lib.base_fields())
  assert all(len(line) <= 80 for line in out.splitlines())
  assert not re.search(r'^  --(fedprox_mu|logtostderr)', out, re.M)
  assert full.stdout.startswith('Runs one federated training experiment.')
  assert '  --fedprox_mu:' in full.stdout


def _choices(out, flag):
  """The values `--help` lists under `--flag`, as a list."""
  match = re.search(rf'^  --{flag}=.*\n((?:      .*\n)+)', out, re.M)
  assert match, flag
  text = ' '.join(match[1].split())
  assert text.startswith('one of: '), text
  return text[len('one of: ') :].split(', ')


def test_run_help_lists_the_values_a_flag_takes():
  from fedjax_mr.pipeline import config as config_lib

  out = _run('experiments.run', '--help').stdout
  fields = {f.name: f for f in config_lib.base_fields()}
  for flag in ('algorithm', 'dataset', 'model', 'partition'):
    assert _choices(out, flag) == list(config_lib.choices(fields[flag]))
  assert 'fedmr' in _choices(out, 'algorithm')
  assert all(len(line) <= 80 for line in out.splitlines())


@pytest.mark.parametrize('program', sorted(_GROUPED))
def test_the_other_programs_help_lists_their_flags_by_concern_too(program):
  from fedjax_mr.pipeline import config as config_lib
  from fedjax_mr.pipeline import stitch_config

  proc = _run(f'experiments.{program}', '--help')
  assert proc.returncode == 0, proc.stderr
  out = proc.stdout
  assert out.startswith(_docstring_start(program))
  heading, first = _GROUPED[program]
  assert f'\n{heading}:\n  --{first}  ' in out, out
  listed = re.findall(r'^  --(\w+)=', out, re.M)
  assert len(listed) == len(set(listed))
  stitching = 'stitch' in program
  fields = stitch_config.fields() if stitching else config_lib.base_fields()
  expected = {f.name for f in fields}
  if program == 'compare':
    assert '\nData:\n  --dataset=fashion_mnist  ' in out
    expected |= {'variants', 'variant', 'seeds', 'last', 'summarize_only'}
  if program.startswith('deploy'):
    expected |= _DEPLOY_FLAGS
  assert set(listed) >= expected, expected - set(listed)
  assert not re.search(r'^  --(fedprox_mu|logtostderr|out)=', out, re.M)
  assert all(len(line) <= 80 for line in out.splitlines())
  if not stitching:
    assert 'scaffold' in _choices(out, 'algorithm')


# What the deploy programs hand the launcher, printed by a stand-in for
# `launch.run` (no federation starts): every path of the config and the
# SuperLink's CA file.
_DEPLOY_PATHS = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from fedjax_mr.core import config_tree
from fedjax_mr.deploy import launch
from fedjax_mr.pipeline import config, stitch_config

FIELDS = config.base_fields()
if 'stitch' in 'PROGRAM':
  FIELDS = stitch_config.fields()

def run(config, nodes, **kwargs):
  paths = {f.name: config_tree.get(config, f.path) for f in FIELDS}
  paths['root_certificates'] = kwargs['superlink'].root_certificates
  print(json.dumps(paths))

launch.run = run
from experiments import PROGRAM
sys.argv = ['PROGRAM', *sys.argv[2:]]
PROGRAM.entry()
"""


@pytest.mark.parametrize(
  'program, relative',
  [
    (
      'deploy',
      {
        'data_dir': 'mydata',
        'partition_file': 'parts.json',
        'init_from': 'runs/pool/cnn_mnist',
        'workdir': 'runs/deployed',
      },
    ),
    (
      'deploy_stitch',
      {
        'pool': 'runs/pool',
        'imagenet_pool': 'imagenet',
        'data_dir': 'mydata',
        'label_map': 'map.json',
        'energy_profile': 'tx2.json',
        'energy_mix': 'tx2.json@0.5:1,tx2_chained:1;tx2.json',
        'workdir': 'runs/stitch_deployed',
      },
    ),
  ],
)
def test_a_deploy_programs_relative_paths_reach_its_config_absolute(
  tmp_path, program, relative
):
  # The federation's processes run in <workdir>/flower: a relative
  # --pool=runs/pool passed the launcher's checks, then failed there.
  (tmp_path / 'map.json').write_text('[]')
  (tmp_path / 'tx2.json').write_text('{}')
  proc = _run(
    '-c',
    _DEPLOY_PATHS.replace('PROGRAM', program),
    fork_server.REPO,
    *(f'--{name}={value}' for name, value in relative.items()),
    '--superlink=127.0.0.1:9',
    '--root_certificates=ca.crt',
    cwd=tmp_path,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  for name, value in {**relative, 'root_certificates': 'ca.crt'}.items():
    expected = str(tmp_path / value)
    if name == 'energy_mix':  # each profile file; a bundled one by name
      expected = f'{tmp_path}/tx2.json@0.5:1,tx2_chained:1;{tmp_path}/tx2.json'
    assert got[name] == expected, name
