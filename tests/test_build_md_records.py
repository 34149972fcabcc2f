"""The scale and benchmark tables (once BUILD.md's, now on the site's
"Scale and benchmarks" page, docs/results/scale.md, or wherever each
moves), figure by figure, from their records in docs/results/scale.

Each row names its record (or the table's paragraph names the logs);
every printed figure must equal the record's value formatted to the
printed digits: peak host memory as the benchmark prints it (`peak host
memory: N MiB`) or as `/usr/bin/time -v` does (`Maximum resident set size
(kbytes)`, in MiB or GiB of 1,024), round and limit times, per-client
overheads and samples/s from the benchmark's lines, and the prefetch
runs' recorded `round_time_s`. The CPU benchmark tables (`--matrix`,
PyTorch, per algorithm, the zoo's costs) are checked by
tests/test_cpu_figures_records.py.
"""

import functools
import glob
import os
import re

from tests import docs_text
from tests import test_readme_records as readme_records

REPO = os.path.dirname(os.path.dirname(__file__))
SCALE = os.path.join(REPO, 'docs', 'results', 'scale')
H200_LOGS = ('call1.log', 'call2.log')  # docs/results/scale/gpu_h200

FIGURE = r'[−-]?[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?'

STREAMING = '| algorithm | K | before (stacked) |'
SYNTHETIC = '| algorithm | peak host memory (`/usr/bin/time -v`) |'
H200 = '| model | K | chunk |'
SAMPLER = '| K | round before → after |'
OVERHEAD = '| K | code | round | limit |'
ARENAS = '| | 1 device | 2 devices | 2 over 1 |'
PREFETCH = '| placement | prefetch | run | round 2 | round 3 |'


def _page(header):
  """The text of the page that holds the table whose header starts so."""
  return docs_text.read(docs_text.holding(header))


def _build_md():
  """Every page of the documentation (the sentences' figures are found
  wherever they moved)."""
  return docs_text.all_text()


@functools.cache
def _record(name):
  path = os.path.join(SCALE, name)
  assert os.path.exists(path), f'no record {name}'
  with open(path) as f:
    return f.read()


def _printed(value, text, what):
  """`value` printed as `text`: to its digits, thousands with commas, a
  minus sign as the table prints it."""
  digits = len(text.partition('.')[2])
  want = f'{value:,.{digits}f}'.replace('-', '−')
  assert want == text.replace('-', '−'), f'{what}: {value} is not {text}'


def _figures(cell, values, what):
  """Every figure of `cell`, in order, is the one of `values` there."""
  found = re.findall(FIGURE, cell)
  assert len(found) == len(values), f'{what}: {cell!r} has not {values}'
  for value, text in zip(values, found):
    _printed(value, text, what)


def _one(pattern, text, what):
  found = re.findall(pattern, text, re.M)
  assert len(found) == 1, f'{what}: {len(found)} lines {pattern!r}'
  return found[0]


def _rss_kib(name):
  """`/usr/bin/time -v`'s maximum resident set of record `name`, in KiB."""
  return int(
    _one(r'Maximum resident set size \(kbytes\): (\d+)', _record(name), name)
  )


def check_streaming_table(text):
  """Peak host memory of FedAvg's (and beside it FedExP's and FedProx's)
  stacked and streamed rounds: the benchmark's `peak host memory` line of
  before_<record>.txt and after_<record>.txt; an empty cell, no record."""
  table = readme_records._table(text, STREAMING)
  assert table[0] == [
    'algorithm',
    'K',
    'before (stacked)',
    'after (streamed)',
    'record',
  ]
  for algorithm, k, before, after, name in table[1:]:
    name = name.strip('`')
    for when, cell in (('before', before), ('after', after)):
      path = f'{when}_{name}.txt'
      if not cell:
        assert not os.path.exists(os.path.join(SCALE, path)), path
        continue
      record = _record(path)
      ran, clients = _one(r'^(\w+), cnn_mnist .*: K=(\d+) of', record, path)
      assert algorithm.split(' (')[0].lower() == ran, (algorithm, path)
      _printed(int(clients), k, f'{path}: K')
      mib = int(_one(r'^peak host memory: (\d+) MiB$', record, path))
      assert cell.endswith(' MiB'), cell
      _figures(cell, [mib], path)


def check_synthetic_table(text):
  """Peak host memory of the 10⁶-client Synthetic runs: the maximum
  resident set of each record the row names (`…_arena2`: the one before
  it with that suffix; `*`: the one of those files that has it), in the
  unit printed; a commit in the cell is the one the record's name ends
  with."""
  table = readme_records._table(text, SYNTHETIC)
  assert len(table[0]) == 3, table[0]
  ran = None
  for label, cell, names in table[1:]:
    files = []
    for name in re.findall(r'`([^`]+)`', names):
      if name.startswith('…'):
        name = files[-1][: -len('.txt')] + name[1:]
      matched = sorted(glob.glob(os.path.join(SCALE, name + '.txt')))
      matched = [
        m for m in matched if 'Maximum resident' in _record(os.path.basename(m))
      ]
      assert len(matched) == 1, (name, matched)
      files.append(os.path.basename(matched[0]))
    if not label.startswith('the same'):
      ran = label.split(',')[0].lower()
    for path in files:
      assert _one(r'^(\w+) on synthetic', _record(path), path) == ran, path
    sizes = re.findall(rf'({FIGURE}) (MiB|GiB)', cell)
    assert len(sizes) == len(files), (cell, files)
    for (figure, unit), path in zip(sizes, files):
      kib = _rss_kib(path)
      _printed(kib / 1024 ** {'MiB': 1, 'GiB': 2}[unit], figure, path)
    rest = re.sub(rf'{FIGURE} (MiB|GiB)|`MALLOC_ARENA_MAX=2`', ' ', cell)
    for commit in re.findall(r'\b[0-9a-f]{7}\b', rest):
      named = [f for f in files if re.search(r'_[0-9a-f]{7}', f)]
      assert all(commit in f for f in named), (commit, files)
      rest = rest.replace(commit, ' ')
    assert not re.search(r'[0-9]', rest), f'{cell!r}: figures without record'


@functools.cache
def _h200_runs():
  """{name: (status, benchmark line, memory line)} of the H200 logs'
  summaries (`== a_cnn_100 rc=0 23s` then its two lines)."""
  runs = {}
  for log in H200_LOGS:
    summary = log.replace('.log', '_summary.txt')
    lines = _record(os.path.join('gpu_h200', summary)).splitlines()
    for i, line in enumerate(lines):
      if m := re.match(r'^== (\S+) (.*)$', line):
        name, status = m.groups()
        if status.startswith('rc=0'):
          runs[name] = (status, lines[i + 1], lines[i + 2])
        elif not status.startswith('skipped'):
          runs[name] = (status, None, None)
  return runs


def check_h200_table(text):
  """The H200 table: run `<a|b>_<cnn|res>_<K>[_c<chunk>]` of the logs
  (a: after, b: before); a round printed in ms is K / samples/s (the
  benchmark prints rounds to the millisecond), as the paragraph under the
  table says."""
  table = readme_records._table(text, H200)
  models = {'cnn_mnist': 'cnn', 'resnet20': 'res'}
  runs = _h200_runs()
  for model, k, chunk, *cells in table[1:]:
    assert model in models, model
    k_int, chunk_int = int(k.replace(',', '')), int(chunk.replace(',', ''))
    _printed(k_int, k, 'K')
    _printed(chunk_int, chunk, 'chunk')
    for when, cell in zip('ba', cells):
      name = f'{when}_{models[model]}_{k_int}'
      if chunk_int != k_int:
        name += f'_c{chunk_int}'
      where = f'{name}: {cell!r}'
      if not cell or cell.startswith('not run'):
        assert name not in runs, where
        continue
      assert name in runs, f'{where}: no such run in {H200_LOGS}'
      status, line, memory = runs[name]
      if cell.startswith('not compiled in'):
        seconds = re.search(r'rc=124 (\d+)s', status).group(1)
        assert cell == f'not compiled in {seconds} s', where
        continue
      assert f'chunk {chunk_int}]' in line, where
      samples = int(re.search(r'\| (\d+) samples/s', line).group(1))
      round_s = float(re.search(r'\| round ([\d.]+)s', line).group(1))
      mib = int(re.search(r'peak device memory: (\d+) MiB', memory).group(1))
      m = re.fullmatch(
        rf'({FIGURE}) (ms|s), ({FIGURE})/s, ({FIGURE}) MiB', cell
      )
      assert m, where
      if m.group(2) == 'ms':
        _printed(1000 * k_int / samples, m.group(1), where)
      else:
        _printed(round_s, m.group(1), where)
      _printed(samples, m.group(3), where)
      _printed(mib, m.group(4), where)


def _bench(name):
  """[(round s, limit s, overhead ms/client, overhead %)] of each run in
  benchmark record `name`, in order."""
  record = _record(name)
  rounds = re.findall(r'\| round ([\d.]+)s .*\| limit ([\d.]+)s', record)
  overheads = re.findall(
    r'^per-client overhead: ([-\d.]+) ms/client \(([-\d.]+)% of the round\)',
    record,
    re.M,
  )
  assert rounds and len(rounds) == len(overheads), name
  return [
    (float(r), float(lim), float(o), float(p))
    for (r, lim), (o, p) in zip(rounds, overheads)
  ]


def check_sampler_table(text):
  """The sparse sampler's before → after table:
  synth_bench_{before,after}_K<K>.txt; the limit is the range of both."""
  table = readme_records._table(text, SAMPLER)
  for k, rounds, limit, overhead in table[1:]:
    k_int = int(k.replace(',', ''))
    _printed(k_int, k, 'K')
    (before,) = _bench(f'synth_bench_before_K{k_int}.txt')
    (after,) = _bench(f'synth_bench_after_K{k_int}.txt')
    where = f'K {k}'
    assert rounds.endswith(' s') and limit.endswith(' s'), where
    assert ' ms (' in overhead, where
    _figures(rounds, [before[0], after[0]], where)
    lo, hi = sorted([before[1], after[1]])
    _figures(limit, [lo, hi], where)
    _figures(overhead, [before[2], after[2], before[3], after[3]], where)


def check_overhead_table(text):
  """Per-client overhead before, with the permutation only and after:
  synth_bench_overhead_{before,after_chunk1,after}_K<K>.txt, each run."""
  table = readme_records._table(text, OVERHEAD)
  codes = {
    'before': 'before',
    'permutation only': 'after_chunk1',
    'after': 'after',
  }
  for k, code, rounds, limit, overhead in table[1:]:
    k_int = int(k.replace(',', ''))
    _printed(k_int, k, 'K')
    runs = _bench(f'synth_bench_overhead_{codes[code]}_K{k_int}.txt')
    where = f'K {k}, {code}'
    assert rounds.endswith(' s') and limit.endswith(' s'), where
    _figures(rounds, [r[0] for r in runs], where)
    _figures(limit, [r[1] for r in runs], where)
    _figures(overhead, [r[2] for r in runs] + [r[3] for r in runs], where)


def check_arenas_table(text):
  """Peak memory of the default run with glibc's default arenas, two
  arenas, and two on 2 devices only: the maximum resident set of
  malloc_arenas/<before|after|new>_<devices>_<pair>.log, in MiB; the
  last column each pair's 2-device run over its 1-device one, and
  `means` the mean of the 2-device runs over that of the 1-device ones."""
  table = readme_records._table(text, ARENAS)
  sides = {'default arenas': 'before', 'two arenas': 'after'}
  for label, one, two, ratio in table[1:]:
    pairs = len(re.findall(FIGURE, one))
    assert pairs >= 2, one
    side = sides.get(label)
    if now := re.fullmatch(
      r'as now: two arenas on 2 devices only \((\d+) pairs; `mem2.sh`, '
      r'load (\d+)–(\d+)\)',
      label,
    ):
      side = 'new'
      loads = re.findall(
        r' load ([\d.]+)$', _record('malloc_arenas/summary2.txt'), re.M
      )
      loads = [float(x) for x in loads]
      want = (str(pairs), f'{min(loads):.0f}', f'{max(loads):.0f}')
      assert now.groups() == want, f'{label}: not {want}'

    assert side, label
    kib = {
      d: [
        _rss_kib(f'malloc_arenas/{side}_{d}_{p}.log')
        for p in range(1, pairs + 1)
      ]
      for d in (1, 2)
    }
    assert one.replace('*', '').endswith(' MiB'), one
    _figures(one, [k / 1024 for k in kib[1]], f'{label}: 1 device')
    _figures(two, [k / 1024 for k in kib[2]], f'{label}: 2 devices')
    over = [100 * (b / a - 1) for a, b in zip(kib[1], kib[2])]
    if 'means' in ratio:
      over.append(100 * (sum(kib[2]) / sum(kib[1]) - 1))
    _figures(ratio, over, f'{label}: 2 over 1')


def check_prefetch_table(text):
  """Round times of rounds 2 and 3 of the six prefetch runs: the
  `round_time_s` that prefetch/run<run>_<placement>_prefetch<1|0>.txt
  recorded for each."""
  table = readme_records._table(text, PREFETCH)
  for placement, prefetch, run, *times in table[1:]:
    assert prefetch in ('yes', 'no'), prefetch
    name = f'prefetch/run{run}_{placement}_prefetch{int(prefetch == "yes")}'
    record = _record(name + '.txt')
    for r, cell in zip((2, 3), times):
      seconds = _one(
        rf'^{{"round": {r}, "round_time_s": ([\d.]+)', record, name
      )
      _figures(cell, [float(seconds)], f'{name}: round {r}')


# Each table's header line (its start) and its check, for
# tests/test_results_tables_tight.py.
TABLES = {
  STREAMING: check_streaming_table,
  SYNTHETIC: check_synthetic_table,
  H200: check_h200_table,
  SAMPLER: check_sampler_table,
  OVERHEAD: check_overhead_table,
  ARENAS: check_arenas_table,
  PREFETCH: check_prefetch_table,
}


def test_streaming_memory_table_is_its_records():
  check_streaming_table(_page(STREAMING))


def test_synthetic_memory_table_is_its_records():
  check_synthetic_table(_page(SYNTHETIC))


def test_h200_table_is_its_logs():
  check_h200_table(_page(H200))


def test_sampler_table_is_its_records():
  check_sampler_table(_page(SAMPLER))


def test_overhead_table_is_its_records():
  check_overhead_table(_page(OVERHEAD))


def test_arenas_table_is_its_records():
  check_arenas_table(_page(ARENAS))


def test_prefetch_table_is_its_records():
  check_prefetch_table(_page(PREFETCH))


def test_the_chunked_rounds_memory_sentences_are_their_records():
  # The price of chunks of 8 in memory: the first run at K = 10⁴ of the
  # overhead records, after against before, and experiments.run's chunked
  # Synthetic run.
  text = ' '.join(_build_md().split())
  bench = re.search(
    rf"the benchmark's peak ({FIGURE}) against ({FIGURE}) MiB in the first "
    rf'run at K = 10⁴ \(maximum resident set ({FIGURE}) against '
    rf'({FIGURE}) MiB\)',
    text,
  )
  assert bench, 'the chunked benchmark memory sentence is gone'
  peaks, sets = [], []
  for side in ('after', 'before'):
    record = _record(f'synth_bench_overhead_{side}_K10000.txt')
    peaks.append(int(re.search(r'peak host memory: (\d+) MiB', record)[1]))
    sets.append(
      int(re.search(r'Maximum resident set size \(kbytes\): (\d+)', record)[1])
      / 1024
    )
  _figures(' '.join(bench.groups()), peaks + sets, 'chunks of 8')
  run = re.search(
    rf'({FIGURE}) MiB maximum resident set with chunks of 8 '
    r'\(`synth_fedavg_chunk8.txt`\)',
    text,
  )
  assert run, 'the chunked run memory sentence is gone'
  kib = _rss_kib('synth_fedavg_chunk8.txt')
  _printed(kib / 1024, run.group(1), 'synth_fedavg_chunk8')


def test_the_h200_paragraphs_figures_are_its_logs():
  # Chunks of 1,000 against all of K = 10,000 at once (cnn_mnist, after),
  # and the range of the after-over-before speed differences at chunk = K.
  text = ' '.join(_build_md().split())
  chunked = re.search(
    rf'took ({FIGURE}) MiB in chunks of 1,000 against ({FIGURE}) MiB all '
    rf'at once, for ({FIGURE}) % more time',
    text,
  )
  spread = re.search(
    rf'differences at chunk = K \(({FIGURE}) % to \+'
    rf'({FIGURE}) %\)',
    text,
  )
  assert chunked and spread, "the H200 paragraph's figures are gone"
  runs = _h200_runs()

  def figures(name):
    _, line, memory = runs[name]
    samples = int(re.search(r'\| (\d+) samples/s', line).group(1))
    mib = int(re.search(r'peak device memory: (\d+) MiB', memory).group(1))
    return samples, mib

  (whole, whole_mib), (part, part_mib) = (
    figures('a_cnn_10000'),
    figures('a_cnn_10000_c1000'),
  )
  _figures(
    ' '.join(chunked.groups()),
    [part_mib, whole_mib, 100 * (whole / part - 1)],
    'chunks of 1,000',
  )
  gains = [
    100 * (figures(f'a_{m}_{k}')[0] / figures(f'b_{m}_{k}')[0] - 1)
    for m, k in [('cnn', 100), ('cnn', 1000), ('cnn', 10000)]
    + [('res', 100), ('res', 1000)]
  ]
  _figures(' '.join(spread.groups()), [min(gains), max(gains)], 'spread')
