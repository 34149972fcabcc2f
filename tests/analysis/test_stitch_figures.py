"""experiments.stitch_figures on hand-written workdirs with known numbers.

Every invocation runs in one subprocess (`tests.bad_invocations`, flags
reset between cases); the expected table cells are computed by hand from
the rows written here.
"""

import json
import os
import re

import numpy as np
import pytest

from fedjax_mr.analysis import stitch_figures as figures
from fedjax_mr.analysis import stitch_tables
from fedjax_mr.core import errors
from fedjax_mr.core import jsonfile
from fedjax_mr.stitch import state as state_lib
from tests import fork_server

REPO = os.path.dirname(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
_LOG_LINE = re.compile(r'^[IWEF]\d{4} ')  # absl log lines (not errors)


def _jsonl(path, rows):
  with open(path, 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)


def _json(path, obj):
  with open(path, 'w') as f:
    json.dump(obj, f)


def _stitch_dir(
  path,
  *,
  times,
  pool_sizes,
  networks,
  config,
  local=None,
  log_extra=(),
  pool_models=None,
):
  """A FedStitch workdir: log.jsonl, results.json, state.npz."""
  os.makedirs(path)
  log = []
  for r, (t, sizes) in enumerate(zip(times, pool_sizes)):
    row = {
      'round': r,
      'clients': [],
      'ranks': [],
      'client_time_s': [t / 2],
      'depth': 1,
      'pool_sizes': sizes,
      'round_time_s': t,
    }
    row.update(log_extra[r] if r < len(log_extra) else {})
    log.append(row)
  _jsonl(os.path.join(path, 'log.jsonl'), log)
  best = max(networks, key=lambda n: n['head'])
  _json(
    os.path.join(path, 'results.json'),
    {
      'config': config,
      'networks': sorted(networks, key=lambda n: -n['head']),
      'best': best,
      'local': local,
      'rounds': len(times),
      **({} if pool_models is None else {'pool_models': pool_models}),
    },
  )
  state_lib.write_document(
    os.path.join(path, 'state.npz'),
    {'round': len(times), 'weights': np.array([0.3, 0.1, 0.4, 0.2])},
    {'aggregation': config['aggregation'], 'prune': config['prune']},
  )


def _run_dir(path, accs, rounds, time_s=60.0, eval_s=6.0):
  """An experiments.run workdir: one evaluated row per round."""
  os.makedirs(path)
  _jsonl(
    os.path.join(path, 'metrics.jsonl'),
    [
      {
        'round': i + 1,
        'train_loss': 0.5,
        'test_accuracy': a,
        'round_time_s': time_s,
        'eval_time_s': eval_s,
      }
      for i, a in enumerate(accs)
    ],
  )
  _json(os.path.join(path, 'config.json'), {'rounds': rounds})


@pytest.fixture(scope='module')
def dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp('figs')
  d = {k: str(root / k) for k in ('a', 'b', 'c', 'r', 'r2', 'pool', 'm')}
  # A: 4 clients; rounds of 10, 20 and 30 s; networks finished after
  # rounds 2 (50 %) and 3 (70 %, 60 %).
  _stitch_dir(
    d['a'],
    times=[10.0, 20.0, 30.0],
    pool_sizes=[[5, 5], [5], [3]],
    networks=[
      {'path': 'n1', 'round': 2, 'head': 0.5},
      {'path': 'n2', 'round': 3, 'head': 0.7},
      {'path': 'n3', 'round': 3, 'head': 0.6},
    ],
    config={'prune': True, 'aggregation': 'rl'},
    local={'clients': [0, 1], 'best': [0.4, 0.2], 'mean_best': 0.3},
    # Each pool model alone, as the run evaluated it.
    pool_models={'zeta': {'head': 0.25}, 'alpha': {'head': 0.65}},
    log_extra=[
      {'clients': [0, 1, 2], 'ranks': [0.8, 0.4, 0.9]},
      {'clients': [1, 3], 'ranks': [0.6, None]},
      {'clients': [0, 3], 'ranks': [0.5, 0.7], 'depth': 2},
    ],
  )
  # Classes per client: 2, 1, 3, 2.
  _json(
    os.path.join(d['a'], 'partition.json'),
    {'label_histograms': [[5, 5, 0], [10, 0, 0], [3, 3, 3], [0, 4, 4]]},
  )
  # B: without the optimiser, uniform voting, 55 %.
  _stitch_dir(
    d['b'],
    times=[40.0, 50.0, 60.0],
    pool_sizes=[[10, 10], [10], [10]],
    networks=[{'path': 'm1', 'round': 3, 'head': 0.55}],
    config={'prune': False, 'aggregation': 'uniform'},
    pool_models={'alpha': {'head': 0.45}},
  )
  # C: a FedStitch run still going (no results.json).
  os.makedirs(d['c'])
  _jsonl(os.path.join(d['c'], 'log.jsonl'), [{'round': 0, 'clients': []}])
  # R: 12 evaluated rounds of 1 %, 2 %, ..., 12 %: last 10 mean 7.5 %.
  _run_dir(d['r'], [i / 100 for i in range(1, 13)], rounds=12)
  # R2: 2 of 20 rounds.
  _run_dir(d['r2'], [0.1, 0.3], rounds=20)
  os.makedirs(os.path.join(d['pool'], 'cnn'))
  _json(
    os.path.join(d['pool'], 'cnn', 'meta.json'),
    {'model': 'cnn_mnist', 'test_accuracy': 0.809},
  )
  d['pool_model'] = os.path.join(d['pool'], 'cnn')
  # A pool of one untrained cnn_mnist, for the memory figure.
  import jax

  from fedjax_mr.models import model as model_lib
  from fedjax_mr.stitch import pool as pool_lib

  model = model_lib.get('cnn_mnist', 10, (28, 28, 1))
  variables = model.init(jax.random.key(0))
  pool_lib.save_model(d['m'], 'cnn', model, variables)
  d['param_bytes'] = sum(
    np.asarray(x).nbytes for x in jax.tree.leaves(variables)
  )
  return d


def _outs(root):
  return {k: str(root / k) for k in FIGURE_CASES}


FIGURE_CASES = [
  'table3',
  'acc_vs_time',
  'acc_eval',
  'acc_round',
  'search_space',
  'voting',
  'rank',
  'memory',
]


@pytest.fixture(scope='module')
def results(dirs, tmp_path_factory):
  """{case: (exit code, stderr, wrote)} of one subprocess running every
  good and bad invocation, and the output folders."""
  root = tmp_path_factory.mktemp('out')
  out = _outs(root)
  scratch = str(root / 'scratch')
  d = dirs
  good = {
    'table3': [
      '--figure=table3',
      '--runs=FedStitch:iid={a},noniid={b};'
      'FedAvg:iid={r},noniid={r2};'
      'Pool cnn:iid={pool_model},noniid=/nonexistent/x;'
      'Going:iid={c}'.format(**d),
    ],
    'acc_vs_time': [
      '--figure=acc_vs_time',
      f'--runs=FedStitch:iid={d["a"]};FedAvg:iid={d["r"]};Gone:iid=/no/x',
    ],
    'acc_eval': [
      '--figure=acc_vs_time',
      '--include_eval',
      '--time_unit=hours',
      f'--runs=FedAvg:noniid={d["r"]}',
    ],
    'acc_round': [
      '--figure=acc_vs_round',
      f'--runs=FedStitch:iid={d["a"]};FedAvg:iid={d["r"]},noniid={d["r2"]}',
    ],
    'search_space': [
      '--figure=search_space',
      f'--runs=with:{d["a"]};without:{d["b"]}',
    ],
    'voting': [
      '--figure=voting',
      f'--runs=RL:noniid={d["a"]};Uniform:noniid={d["b"]}',
    ],
    'rank': ['--figure=rank_vs_classes', f'--runs=A:{d["a"]}'],
    'memory': [
      '--figure=memory',
      f'--pool={d["m"]}',
      '--models=cnn_mnist',
      '--batch_size=2',
      '--train_batch_size=2',
    ],
  }
  S = f'--output={scratch}'
  bad = {
    'no_figure': ([S], '--figure'),
    'bad_figure': (['--figure=bogus', S], '--figure'),
    'no_output': (['--figure=table3', f'--runs=x:{d["a"]}'], '--output'),
    'no_runs': (['--figure=table3', S], '--runs'),
    'bad_runs': (['--figure=voting', '--runs=nolabel', S], '--runs'),
    'twice': (['--figure=table3', '--runs=x:/a;x:/b', S], '--runs'),
    'bad_json': (['--figure=table3', '--runs=/nonexistent.json', S], '--runs'),
    'no_points': (['--figure=acc_vs_time', '--runs=x:/no/such', S], '--runs'),
    'no_rounds': (['--figure=acc_vs_round', '--runs=x:/no/such', S], '--runs'),
    'no_log': (['--figure=search_space', f'--runs=x:{d["r"]}', S], '--runs'),
    'last': (
      ['--figure=table3', f'--runs=x:{d["r"]}', '--last=0', S],
      '--last',
    ),
    'last_round': (
      ['--figure=acc_vs_round', f'--runs=x:{d["r"]}', '--last=0', S],
      '--last',
    ),
    'two_runs': (
      ['--figure=rank_vs_classes', f'--runs=x:{d["a"]};y:{d["b"]}', S],
      '--runs',
    ),
    'no_partition': (
      ['--figure=rank_vs_classes', f'--runs=x:{d["b"]}', S],
      '--partition_summary',
    ),
    'bad_partition': (
      [
        '--figure=rank_vs_classes',
        f'--runs=x:{d["a"]}',
        '--partition_summary=/nonexistent/p.json',
        S,
      ],
      '--partition_summary=/nonexistent/p.json',
    ),
    'memory_nothing': (['--figure=memory', S], '--pool'),
    'memory_batch': (
      ['--figure=memory', f'--pool={d["m"]}', '--batch_size=0', S],
      '--batch_size',
    ),
    'ft_layers': (
      ['--figure=memory', f'--pool={d["m"]}', '--ft_layers=9', S],
      '--ft_layers: must be in 1..4',
    ),
    'memory_model': (
      ['--figure=memory', '--models=bogus', '--input_shape=28,28,1', S],
      'bogus',
    ),
    'positional': (['--figure=table3', 'extra'], 'unexpected arguments'),
  }
  names = list(good) + list(bad)
  argvs = [[*good[k], f'--output={out[k]}'] for k in good] + [
    bad[k][0] for k in bad
  ]
  # A process of its own, forked from one that imported the libraries the
  # programs share (tests/fork_server.py).
  proc = fork_server.run_module(
    'tests.bad_invocations',
    'experiments.stitch_figures',
    json.dumps(argvs),
    scratch,
    cwd=REPO,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr
  got = dict(zip(names, json.loads(proc.stdout)))
  return got, out, {k: v[1] for k, v in bad.items()}


def _read(out, name):
  with open(os.path.join(out, name)) as f:
    return f.read()


def _load(out, name):
  with open(os.path.join(out, name)) as f:
    return json.load(f)


@pytest.mark.parametrize('case', FIGURE_CASES)
def test_every_figure_runs(results, case):
  got, _, _ = results
  assert got[case]['code'] == 0, got[case]['stderr']


def test_table3_cells(results):
  _, out, _ = results
  text = _read(out['table3'], 'table3.md')
  lines = text.splitlines()
  assert lines[0] == '| method | iid | noniid |'
  assert '| FedStitch | 70.00 | 55.00 |' in lines
  assert '| Local (FedStitch) | 30.00 |  |' in lines
  # Pool models alone, in name order, under the run that evaluated them.
  i = lines.index('| Local (FedStitch) | 30.00 |  |')
  assert lines[i + 1] == '| alpha alone (FedStitch) | 65.00 | 45.00 |'
  assert lines[i + 2] == '| zeta alone (FedStitch) | 25.00 |  |'
  assert (
    '| FedAvg | 7.50 (best 12.00) | 20.00 (best 30.00) (running, round 2/20) |'
    in lines
  )
  assert '| Pool cnn | 80.90 | – |' in lines
  assert '| Going | running |  |' in lines
  data = _load(out['table3'], 'table3.json')
  assert [r['method'] for r in data['rows']][:4] == [
    'FedStitch',
    'Local (FedStitch)',
    'alpha alone (FedStitch)',
    'zeta alone (FedStitch)',
  ]
  fedavg = data['rows'][4]['cells']
  assert fedavg['iid']['accuracy'] == pytest.approx(0.075)
  assert fedavg['iid']['best'] == pytest.approx(0.12)
  assert fedavg['noniid']['status'] == 'running'
  assert data['rows'][5]['cells']['noniid']['status'] == 'missing'


def test_table3_shows_the_probe_beside_each_training_runs_head(tmp_path):
  stitch = str(tmp_path / 'stitch')
  os.makedirs(stitch)
  net = {'path': 'n', 'round': 2, 'knn': 0.9}
  _json(
    os.path.join(stitch, 'results.json'),
    {
      'eval': 'knn',
      'knn_at': 'trunk',
      'networks': [net],
      'best': net,
      'local': {'clients': [1], 'best': [0.8], 'mean_best': 0.8},
      'pool_models': {'cnn': {'knn': 0.85}},
      'rounds': 3,
    },
  )
  probed, plain = str(tmp_path / 'probed'), str(tmp_path / 'plain')
  _run_dir(probed, [0.5, 0.7, 0.9], rounds=3)
  _run_dir(plain, [0.6, 0.8], rounds=2)
  _json(
    os.path.join(probed, stitch_tables.PROBE_FILE),
    {'rounds': [2, 3], 'accuracy': [0.8, 0.84], 'mean': 0.82},
  )
  runs = {'FedStitch': {'iid': stitch}, 'FT': {'iid': probed}}
  runs['FedAvg'] = {'iid': plain}
  data, text = stitch_tables.accuracy_table(runs, last=2)
  lines = text.splitlines()
  assert lines[0] == '| method | iid | iid, 5-NN on trunk |'
  assert '| FedStitch | 90.00 | 90.00 |' in lines
  assert '| Local (FedStitch) | 80.00 | 80.00 |' in lines
  assert '| cnn alone (FedStitch) | 85.00 | 85.00 |' in lines
  assert '| FT | 80.00 (best 90.00) | 82.00 (rounds 2–3) |' in lines
  assert '| FedAvg | 70.00 (best 80.00) | – |' in lines
  assert data['probed'] and data['rows'][3]['cells']['iid']['probe'] == 0.82
  # Without any probe.json, the table is as it was: no such column.
  del runs['FT']
  _, text = stitch_tables.accuracy_table(runs, last=2)
  assert text.splitlines()[0] == '| method | iid |'


def test_acc_vs_time_points(results):
  _, out, _ = results
  data = _load(out['acc_vs_time'], 'acc_vs_time.json')
  curves = data['curves']['iid']
  assert set(curves) == {'FedStitch', 'FedAvg'}  # 'Gone' has no points
  # Networks finished after rounds 0-1 (10 + 20 s) and 0-2 (+ 30 s).
  assert curves['FedStitch']['seconds'] == [30.0, 60.0]
  assert curves['FedStitch']['accuracy'] == [0.5, 0.7]
  assert curves['FedAvg']['seconds'] == [60.0 * k for k in range(1, 13)]
  assert not data['evaluation_included']
  assert os.path.getsize(os.path.join(out['acc_vs_time'], 'acc_vs_time.png'))
  with_eval = _load(out['acc_eval'], 'acc_vs_time.json')
  assert with_eval['evaluation_included']
  seconds = with_eval['curves']['noniid']['FedAvg']['seconds']
  assert seconds == [66.0 * k for k in range(1, 13)]


def test_acc_vs_round_curves(results):
  _, out, _ = results
  data = _load(out['acc_round'], 'acc_vs_round.json')['curves']
  assert data['iid']['FedStitch'] == {
    'kind': 'stitch',
    'path': data['iid']['FedStitch']['path'],
    'level': 0.7,
  }
  fedavg = data['iid']['FedAvg']
  assert fedavg['round'] == list(range(1, 13))
  assert fedavg['gain'] is None  # 12 rounds: no mean 20 rounds back
  assert data['noniid']['FedAvg']['accuracy'] == [0.1, 0.3]
  # The solid line: the mean of the last 10 (here all) evaluations so far.
  assert data['noniid']['FedAvg']['mean'] == pytest.approx([0.1, 0.2])
  assert fedavg['mean'][-1] == pytest.approx(np.mean(fedavg['accuracy'][-10:]))
  assert _load(out['acc_round'], 'acc_vs_round.json')['last'] == 10
  assert os.path.getsize(os.path.join(out['acc_round'], 'acc_vs_round.png'))


def test_trailing_means_by_hand():
  # Window 3 over 1, 2, 3, 4, 8: 1, 1.5, 2, 3, 5.
  means = stitch_tables.trailing_means([1, 2, 3, 4, 8], window=3)
  assert means == pytest.approx([1, 1.5, 2, 3, 5])
  assert stitch_tables.trailing_means([0.4, 0.6], window=1) == [0.4, 0.6]
  with pytest.raises(ValueError, match='window must be ≥ 1, got 0'):
    stitch_tables.trailing_means([0.5], window=0)


def test_round_axis_floor_leaves_out_each_runs_first_fifth():
  # 20 trailing means: the first four (0.1, 0.3, 0.2, 0.5) are below the
  # axis, the lowest of the rest is 0.8; the probe's 0.75 and FedStitch's
  # 0.85 count; single evaluations ('accuracy') do not.
  means = [0.1, 0.3, 0.2, 0.5] + [0.8] * 6 + [0.9] * 10
  run = {'kind': 'run', 'accuracy': [0.0] * 20, 'mean': means}
  stitch = {'kind': 'stitch', 'level': 0.85}
  assert figures.round_axis_floor({'r': run, 's': stitch}) == pytest.approx(79)
  run['probe_accuracy'] = [0.75]
  assert figures.round_axis_floor({'r': run, 's': stitch}) == pytest.approx(74)


def test_trailing_gain_by_hand():
  # Accuracy r/100 at rounds 1..30: the last 10 (21..30) average 0.255,
  # the last 10 by round 10 (1..10) 0.055: a gain of 0.2.
  evaluated = [(r, r / 100) for r in range(1, 31)]
  assert stitch_tables.trailing_gain(evaluated) == pytest.approx(0.2)
  # Round 29 leaves only 9 evaluations by round 9: no gain yet.
  assert stitch_tables.trailing_gain(evaluated[:-1]) is None
  # Every other round: rounds 42..60 against rounds 22..40, 0.2 apart.
  sparse = [(r, r / 100) for r in range(2, 61, 2)]
  assert stitch_tables.trailing_gain(sparse) == pytest.approx(0.2)
  flat = [(r, 0.9) for r in range(1, 101)]
  assert stitch_tables.trailing_gain(flat, window=5, span=50) == pytest.approx(
    0.0
  )
  with pytest.raises(ValueError, match='window and span'):
    stitch_tables.trailing_gain(flat, window=0)


def test_table3_gives_each_long_runs_rounds_and_trailing_gain(tmp_path):
  rising, flat = str(tmp_path / 'rising'), str(tmp_path / 'flat')
  _run_dir(rising, [r / 100 for r in range(1, 31)], rounds=30)
  _run_dir(flat, [0.5 + 0.001 * (r % 2) for r in range(1, 41)], rounds=40)
  runs = {'up': {'iid': rising}, 'level': {'iid': flat}}
  data, text = stitch_tables.accuracy_table(runs, last=10)
  lines = text.splitlines()
  assert '| up | 25.50 (best 30.00; 30 rounds, +20.00 in 20, rising) |' in lines
  assert '| level | 50.05 (best 50.10; 40 rounds, +0.00 in 20, flat) |' in lines
  assert 'flat: under 0.2 before rounding' in text
  # 0.199 points prints as +0.20 but is under the criterion: flat.
  edge = str(tmp_path / 'edge')
  _run_dir(edge, [0.5] * 10 + [0.5] * 10 + [0.50199] * 10, rounds=30)
  _, text = stitch_tables.accuracy_table({'edge': {'iid': edge}}, last=10)
  assert '30 rounds, +0.20 in 20, flat) |' in text
  assert data['rows'][0]['cells']['iid']['gain'] == pytest.approx(0.2)


def test_search_space_table(results):
  _, out, _ = results
  lines = _read(out['search_space'], 'search_space.md').splitlines()
  assert '| with | on | 3 | 6.0 | 10 → 3 | 60.0 | 2.50× | 70.00 |' in lines
  assert '| without | off | 3 | 13.3 | 20 → 10 | 150.0 |  | 55.00 |' in lines
  data = _load(out['search_space'], 'search_space.json')
  assert data['with']['candidates'] == [10, 5, 3]
  assert data['without']['seconds'] == [40.0, 50.0, 60.0]
  assert os.path.exists(os.path.join(out['search_space'], 'search_space.png'))


def test_voting_table(results):
  _, out, _ = results
  lines = _read(out['voting'], 'voting.md').splitlines()
  assert '| RL | rl | 70.00 |' in lines
  assert '| Uniform | uniform | 55.00 |' in lines
  assert '| RL − Uniform |  | +15.00 |' in lines
  data = _load(out['voting'], 'voting.json')
  assert data['difference_points']['noniid'] == pytest.approx(15.0)


def test_rank_vs_classes(results):
  _, out, _ = results
  lines = _read(out['rank'], 'rank_vs_classes.md').splitlines()
  # 1 class: client 1 (ranks 0.4, 0.6; weight 0.1 × 4; alone 20 %);
  # 2: clients 0 and 3 (0.8, 0.5, 0.7; (0.3 + 0.2) × 4 / 2; 40 %); 3: client 2.
  assert '| 1 | 1 | 2 | 0.500 | 0.400 | 20.00 |' in lines
  assert '| 2 | 2 | 3 | 0.667 | 1.000 | 40.00 |' in lines
  assert '| 3 | 1 | 1 | 0.900 | 1.600 | – |' in lines
  data = _load(out['rank'], 'rank_vs_classes.json')
  assert data['by_classes']['2']['mean_rank_by_depth'] == {
    '1': pytest.approx(0.8),
    '2': pytest.approx(0.6),
  }
  assert len(data['points']) == 6  # the None rank is left out
  assert os.path.exists(os.path.join(out['rank'], 'rank_vs_classes.png'))


def test_memory_bars(results, dirs):
  _, out, _ = results
  data = _load(out['memory'], 'memory.json')
  bars = data['bars_bytes']
  assert list(bars) == [
    'FedStitch',
    'FedStitch (one block)',
    'FT-Full cnn',
    'FT-Part cnn',
    'cnn_mnist (scratch)',
  ]
  # The pool's blocks hold exactly the model's variables.
  blocks = data['blocks']
  assert sum(b['parameter_bytes'] for b in blocks) == dirs['param_bytes']
  assert bars['FedStitch'] == dirs['param_bytes'] + max(
    b['working_bytes'] for b in blocks
  )
  assert bars['FedStitch (one block)'] == max(
    b['forward_bytes'] for b in blocks
  )
  # The same model trained from scratch or fine-tuned in full: one step.
  assert bars['FT-Full cnn'] == bars['cnn_mnist (scratch)']
  assert 0 < bars['FT-Part cnn'] < bars['FT-Full cnn']
  assert os.path.exists(os.path.join(out['memory'], 'memory.png'))
  assert 'FedStitch saves (%)' in _read(out['memory'], 'memory.md')


def test_missing_inputs_are_one_line_errors(results):
  got, _, fragments = results
  for name, fragment in fragments.items():
    r = got[name]
    lines = [
      line
      for line in r['stderr'].splitlines()
      if line.strip() and not _LOG_LINE.match(line)
    ]
    assert r['code'] == 2, (name, r)
    assert len(lines) == 1 and lines[0].startswith('error: '), (name, r)
    assert fragment in lines[0], (name, lines)
    assert not r['wrote'], name


def test_parse_runs_forms(tmp_path):
  spec = 'A:iid=x/1, noniid=x/2; B:y'
  assert stitch_tables.parse_runs(spec) == {
    'A': {'iid': 'x/1', 'noniid': 'x/2'},
    'B': {'run': 'y'},
  }
  path = tmp_path / 'runs.json'
  path.write_text(json.dumps({'A': {'iid': 'x/1'}, 'B': 'y'}))
  assert stitch_tables.parse_runs(str(path)) == {
    'A': {'iid': 'x/1'},
    'B': {'run': 'y'},
  }
  assert stitch_tables.columns_of(stitch_tables.parse_runs(spec)) == [
    'iid',
    'noniid',
    'run',
  ]


def test_a_malformed_file_of_a_workdir_is_one_line_naming_it(tmp_path):
  model = tmp_path / 'model'
  model.mkdir()
  (model / 'meta.json').write_text('{"test_accuracy": "high"}')
  with pytest.raises(jsonfile.JsonFileError) as e:
    stitch_tables.cell(str(model))
  assert str(e.value) == (
    f'{model}/meta.json: "test_accuracy" is the string "high", not a number'
  )
  (model / 'meta.json').write_text('[0.5]')
  with pytest.raises(jsonfile.JsonFileError, match='holds a list, not an'):
    stitch_tables.cell(str(model))


def test_a_bad_partition_summary_or_runs_file_names_the_field(tmp_path):
  path = tmp_path / 'partition.json'
  path.write_text('{"label_histograms": [[1, 0], [0, "2"]]}')
  with pytest.raises(jsonfile.JsonFileError) as e:
    figures.read_classes_per_client(str(path))
  assert e.value.reason == (
    '"label_histograms"[1][1] is the string "2", not an integer'
  )
  path.write_text('{"label_histograms": [[1, 0], [0, 2]]}')
  assert figures.read_classes_per_client(str(path)) == [1, 1]
  runs = tmp_path / 'runs.json'
  runs.write_text('[1]')
  with pytest.raises(errors.ConfigError) as e:
    stitch_tables.parse_runs(str(runs))
  assert str(e.value).startswith(
    f'`runs={runs}`: holds a list, not an object (want a JSON object'
  )
