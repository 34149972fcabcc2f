"""stitch_paper.make, the library call behind experiments.stitch_figures,
on the hand-written workdirs of test_stitch_figures (no flags, no
subprocess): what it writes, returns and prints, and its errors."""

import json
import os

import pytest

from fedjax_mr.analysis import stitch_paper
from fedjax_mr.core import errors
from tests.analysis import test_stitch_figures as fixtures


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """Two FedStitch runs (a: 4 clients, with partition.json; b) and two
  training runs (r: 12 evaluations of 1 %, ..., 12 %; r2: 2 of 20), as
  test_stitch_figures writes them."""
  root = tmp_path_factory.mktemp('paper')
  d = {k: str(root / k) for k in ('a', 'b', 'r', 'r2')}
  fixtures._stitch_dir(
    d['a'],
    times=[10.0, 20.0, 30.0],
    pool_sizes=[[5, 5], [5], [3]],
    networks=[
      {'path': 'n1', 'round': 2, 'head': 0.5},
      {'path': 'n2', 'round': 3, 'head': 0.7},
    ],
    config={'prune': True, 'aggregation': 'rl'},
    local={'clients': [0, 1], 'best': [0.4, 0.2], 'mean_best': 0.3},
    log_extra=[
      {'clients': [0, 1, 2], 'ranks': [0.8, 0.4, 0.9]},
      {'clients': [1, 3], 'ranks': [0.6, None]},
      {'clients': [0, 3], 'ranks': [0.5, 0.7], 'depth': 2},
    ],
  )
  fixtures._json(
    os.path.join(d['a'], 'partition.json'),
    {'label_histograms': [[5, 5, 0], [10, 0, 0], [3, 3, 3], [0, 4, 4]]},
  )
  fixtures._stitch_dir(
    d['b'],
    times=[40.0, 50.0, 60.0],
    pool_sizes=[[10, 10], [10], [10]],
    networks=[{'path': 'm1', 'round': 3, 'head': 0.55}],
    config={'prune': False, 'aggregation': 'uniform'},
  )
  fixtures._run_dir(d['r'], [i / 100 for i in range(1, 13)], rounds=12)
  fixtures._run_dir(d['r2'], [0.1, 0.3], rounds=20)
  return d


def test_table3_is_written_returned_and_printed_in_order(runs, tmp_path):
  out = str(tmp_path / 'out')
  spec = 'FedStitch:iid={a},noniid={b};FedAvg:iid={r},noniid={r2}'
  printed = []
  made = stitch_paper.make(
    stitch_paper.Setting(
      figure='table3', output=out, runs=spec.format(**runs), last=10
    ),
    log=printed.append,
  )
  assert made.written == [f'{out}/table3.json', f'{out}/table3.md']
  assert printed == [
    made.text.removesuffix('\n'),
    *(f'wrote {p}' for p in made.written),
  ]
  lines = made.text.splitlines()
  assert lines[0] == '| method | iid | noniid |'
  assert '| FedStitch | 70.00 | 55.00 |' in lines
  assert '| Local (FedStitch) | 30.00 |  |' in lines
  # r: the mean of the last 10 of 1 %, ..., 12 % is 7.5 %.
  assert '| FedAvg | 7.50 (best 12.00) | 20.00 (best 30.00)' in made.text
  with open(f'{out}/table3.md') as f:
    assert f.read() == made.text
  with open(f'{out}/table3.json') as f:
    assert json.load(f) == json.loads(json.dumps(made.data))


@pytest.mark.slow  # matplotlib
def test_acc_vs_time_names_the_runs_left_out(runs, tmp_path):
  out = str(tmp_path / 'out')
  printed = []
  made = stitch_paper.make(
    stitch_paper.Setting(
      figure='acc_vs_time',
      output=out,
      runs=f'FedStitch:iid={runs["a"]};Gone:iid=/no/x',
    ),
    log=printed.append,
  )
  assert made.text is None
  assert made.written == [f'{out}/acc_vs_time.json', f'{out}/acc_vs_time.png']
  assert printed[0] == 'no points yet, left out: Gone (iid): /no/x'
  # Networks finished after rounds 0-1 (10 + 20 s) and 0-2 (+ 30 s).
  curve = made.data['curves']['iid']['FedStitch']
  assert curve['seconds'] == [30.0, 60.0]
  assert curve['accuracy'] == [0.5, 0.7]


@pytest.mark.slow  # matplotlib
def test_rank_vs_classes_by_hand(runs, tmp_path):
  made = stitch_paper.make(
    stitch_paper.Setting(
      figure='rank_vs_classes', output=str(tmp_path), runs=f'A:{runs["a"]}'
    )
  )
  # 1 class: client 1 (ranks 0.4, 0.6; weight 0.1 × 4; alone 20 %).
  assert '| 1 | 1 | 2 | 0.500 | 0.400 | 20.00 |' in made.text.splitlines()
  assert made.data['path'] == runs['a']
  assert [os.path.basename(p) for p in made.written] == [
    'rank_vs_classes.json',
    'rank_vs_classes.md',
    'rank_vs_classes.png',
  ]


def _bad_cases(d, tmp):
  p3 = os.path.join(tmp, 'p3.json')
  with open(p3, 'w') as f:
    json.dump({'label_histograms': [[1, 0], [0, 1], [1, 1]]}, f)
  return [
    (dict(), '`figure` is needed: one of table3, acc_vs_time, '),
    (dict(figure='table3', output=None), '`output` is needed'),
    (dict(figure='voting'), '`runs` is needed for `figure`=voting'),
    (dict(figure='acc_vs_round', runs='x:/a', last=0), '`last` must be ≥ 1'),
    (dict(figure='acc_vs_time', runs='x:/a', time_unit='days'), '`time_unit`'),
    (dict(figure='acc_vs_time', runs='x:/no/such'), '`runs`: no workdir has'),
    (dict(figure='search_space', runs=f'x:{d["r"]}'), '`runs`: no FedStitch'),
    (
      dict(figure='rank_vs_classes', runs=f'x:{d["a"]};y:{d["b"]}'),
      '`runs`: rank_vs_classes takes one workdir, got 2',
    ),
    (
      dict(figure='rank_vs_classes', runs=f'x:{d["b"]}'),
      f'`runs`: {d["b"]} has no readable partition.json',
    ),
    (
      dict(figure='rank_vs_classes', runs=f'x:{d["a"]}', partition_summary=p3),
      f'`partition_summary`: {p3} has 3 clients, the run {d["a"]} has 4',
    ),
    (dict(figure='memory', batch_size=0), '`batch_size` must be ≥ 1, got 0'),
    (dict(figure='memory'), '`figure`=memory needs `pool` and/or `models`'),
    (dict(figure='memory', models=('cnn_mnist',)), '`models` needs'),
    (
      dict(figure='memory', models=('cnn_mnist',), input_shape=('28', 'a')),
      '`input_shape`: not integers: 28,a',
    ),
    (
      dict(figure='memory', models=('bogus',), input_shape=(28, 28, 1)),
      '`models`: bogus: ',
    ),
  ]


def test_bad_settings_name_their_field_and_write_nothing(runs, tmp_path):
  out = str(tmp_path / 'out')
  for kwargs, start in _bad_cases(runs, str(tmp_path)):
    kwargs = {'output': out, **kwargs}
    with pytest.raises(errors.ConfigError) as e:
      stitch_paper.make(stitch_paper.Setting(**kwargs))
    assert str(e.value).startswith(start), (kwargs, str(e.value))
    assert not os.path.exists(out), kwargs


def test_a_fedstitch_workdir_of_the_one_format_is_read_as_one(tmp_path):
  # config.json holds the run's identity (so it is no training run) and
  # the final state is the newest checkpoint's document; nothing written.
  from fedjax_mr.analysis import stitch_tables
  from fedjax_mr.runtime import checkpoint
  from fedjax_mr.stitch import state as state_lib
  from tests.stitch import common

  identity = {'seed': 3, 'num_clients': 4}
  (tmp_path / 'config.json').write_text(json.dumps({'identity': identity}))
  (tmp_path / 'metrics.jsonl').write_text('{"round": 1}\n')
  state = state_lib.init_state(common.fake_pool(), 4)._replace(round=1)
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  ckpt.save(1, state_lib.to_checkpoint(state, identity), {})
  ckpt.close()
  before = sorted(p for p in tmp_path.rglob('*'))
  assert stitch_tables.kind_of(str(tmp_path)) == 'stitch'
  payload, saved = stitch_tables.stitch_state(str(tmp_path))
  assert payload['round'] == 1 and len(payload['live']) == 3
  assert saved == identity
  assert stitch_tables.stitch_setting(str(tmp_path), 'seed') == 3
  assert sorted(p for p in tmp_path.rglob('*')) == before
  # A training run's config.json has no identity.
  (tmp_path / 'config.json').write_text('{"rounds": 3}')
  assert stitch_tables.kind_of(str(tmp_path)) == 'run'
