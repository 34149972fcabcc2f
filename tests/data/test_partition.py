import hashlib
import json
import os

import numpy as np
import pytest

from fedjax_mr.core import errors
from fedjax_mr.data import partition


def _check_disjoint_complete(parts, m):
  allidx = np.concatenate(parts)
  assert len(allidx) == m
  np.testing.assert_array_equal(np.sort(allidx), np.arange(m))


def test_iid_equal_sizes_disjoint_complete():
  parts = partition.iid(1003, 10, seed=0)
  _check_disjoint_complete(parts, 1003)
  sizes = sorted(len(p) for p in parts)
  assert sizes == [100] * 7 + [101] * 3


def test_iid_seeded():
  a = partition.iid(100, 4, seed=1)
  b = partition.iid(100, 4, seed=1)
  c = partition.iid(100, 4, seed=2)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))


@pytest.fixture(scope='module')
def labels():
  return np.repeat(np.arange(10), 600)  # 6,000 examples, 10 classes


@pytest.mark.parametrize('alpha', [0.1, 0.5, 100.0])
def test_dirichlet_invariants(labels, alpha):
  parts = partition.dirichlet(labels, 50, alpha, seed=0, min_size=10)
  assert len(parts) == 50
  _check_disjoint_complete(parts, len(labels))
  assert min(len(p) for p in parts) >= 10


def test_dirichlet_alpha_controls_label_skew(labels):
  def mean_classes(alpha):
    parts = partition.dirichlet(labels, 50, alpha, seed=0)
    s = partition.summary(parts, labels, 10)
    return s['classes_per_client_mean']

  skewed, mid, flat = mean_classes(0.1), mean_classes(0.5), mean_classes(100.0)
  assert skewed < mid < flat
  assert skewed < 4.0  # Dir(0.1): a few classes per client
  assert flat > 9.5  # Dir(100): nearly all classes everywhere


def test_dirichlet_seeded_and_shuffled(labels):
  a = partition.dirichlet(labels, 20, 0.5, seed=3)
  b = partition.dirichlet(labels, 20, 0.5, seed=3)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  # Each client's list is shuffled, not grouped by class.
  big = max(a, key=len)
  assert not np.all(np.diff(labels[big]) >= 0)


def test_dirichlet_cap_limits_largest_client(labels):
  parts = partition.dirichlet(labels, 50, 0.1, seed=0)
  cap = len(labels) / 50
  # A client stops receiving new classes once it holds ≥ M/N examples, so it
  # can exceed the cap by at most one class's worth.
  assert max(len(p) for p in parts) < cap + 600


def test_dirichlet_bad_inputs(labels):
  with pytest.raises(errors.ArgumentError, match='^alpha must'):
    partition.dirichlet(labels, 10, 0.0, seed=0)
  with pytest.raises(
    errors.ArgumentError, match='^num_clients with at least 10 examples each'
  ):
    partition.dirichlet(labels, 700, 0.5, seed=0, min_size=10)
  with pytest.raises(errors.ArgumentError, match='^alpha no split'):
    partition.dirichlet(labels, 300, 0.01, seed=0, min_size=19, max_tries=3)


@pytest.mark.parametrize('alpha', [0.003, 1e-300])
@pytest.mark.parametrize('seed', range(3))
def test_dirichlet_tiny_alpha_fails_in_one_named_error(alpha, seed):
  # Dir(alpha) with alpha this small gives (nearly) all of a class to one
  # client, or underflows to no mass at all: 10 classes cannot give 20
  # clients 10 examples each. This used to crash (NaN proportions, then
  # "repeats may not contain negative values").
  labels = np.repeat(np.arange(10), 20)
  with pytest.raises(errors.ArgumentError, match='^alpha .* larger `alpha`'):
    partition.dirichlet(labels, 20, alpha, seed=seed, max_tries=200)


def test_summary(labels):
  parts = [np.array([0, 1, 600]), np.array([5999])]
  s = partition.summary(parts, labels, 10)
  assert s['sizes'] == [3, 1]
  assert s['label_histograms'][0][:2] == [2, 1]
  assert s['label_histograms'][1][9] == 1
  assert s['classes_per_client_mean'] == 1.5


def _dirichlet_by_lists(labels, num_clients, alpha, seed, min_size):
  """The procedure written out client list by client list (the papers'
  reference code's shape), drawing the same random numbers."""
  rng = np.random.default_rng(seed)
  cap = len(labels) / num_clients
  while True:
    parts = [[] for _ in range(num_clients)]
    for c in np.unique(labels):
      idx = np.flatnonzero(labels == c)
      rng.shuffle(idx)
      p = rng.dirichlet(np.full(num_clients, alpha))
      sizes = np.array([len(q) for q in parts])
      p = np.where(sizes < cap, p, 0.0)
      p = p / p.sum()
      cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
      for j, chunk in enumerate(np.split(idx, cuts)):
        parts[j].extend(chunk.tolist())
    if min(len(q) for q in parts) >= min_size:
      out = []
      for q in parts:
        q = np.array(q, dtype=np.int64)
        rng.shuffle(q)
        out.append(q)
      return out


@pytest.mark.parametrize('alpha,seed', [(0.1, 0), (0.5, 3), (5.0, 1)])
def test_dirichlet_equals_the_list_by_list_procedure(labels, alpha, seed):
  got = partition.dirichlet(labels, 20, alpha, seed, min_size=5)
  want = _dirichlet_by_lists(labels, 20, alpha, seed, min_size=5)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


# Shards (the FedAvg paper's split). 20 examples of 4 classes, label i % 4:
# sorted stably by label they read 0 4 8 12 16 | 1 5 9 13 17 | 2 6 10 14 18
# | 3 7 11 15 19, cut into 5 x 2 = 10 shards of 2.
_SHARDS_20 = [
  [0, 4],
  [8, 12],
  [16, 1],
  [5, 9],
  [13, 17],
  [2, 6],
  [10, 14],
  [18, 3],
  [7, 11],
  [15, 19],
]
# numpy's default_rng(0).permutation(10), the deal of seed 0.
_DEAL_SEED_0 = [4, 6, 2, 7, 3, 5, 9, 0, 8, 1]


def test_shards_hand_computed():
  labels = np.arange(20) % 4
  parts = partition.shards(labels, 5, 2, seed=0)
  # Client j gets shards _DEAL_SEED_0[2j], _DEAL_SEED_0[2j + 1].
  want = [
    sorted(_SHARDS_20[4] + _SHARDS_20[6]),
    sorted(_SHARDS_20[2] + _SHARDS_20[7]),
    sorted(_SHARDS_20[3] + _SHARDS_20[5]),
    sorted(_SHARDS_20[9] + _SHARDS_20[0]),
    sorted(_SHARDS_20[8] + _SHARDS_20[1]),
  ]
  assert [p.tolist() for p in parts] == want
  assert want[0] == [10, 13, 14, 17]
  _check_disjoint_complete(parts, 20)
  assert all(p.dtype == np.int64 for p in parts)
  # Shards 2 and 7 straddle a class boundary: client 1 holds all 4 classes
  # (2s), the others 2 classes of 2 examples.
  s = partition.summary(parts, labels, 4)
  assert s['label_histograms'] == [
    [0, 2, 2, 0],
    [1, 1, 1, 1],
    [0, 2, 2, 0],
    [2, 0, 0, 2],
    [2, 0, 0, 2],
  ]
  assert s['unassigned'] == 0


def test_shards_uneven_sizes_use_every_example():
  # 23 examples in 10 shards: the first 3 (in label order) hold 3, the
  # rest 2. Sorted: 0 4 8 12 16 20 | 1 5 9 13 17 21 | 2 6 10 14 18 22 |
  # 3 7 11 15 19.
  shards = [
    [0, 4, 8],
    [12, 16, 20],
    [1, 5, 9],
    [13, 17],
    [21, 2],
    [6, 10],
    [14, 18],
    [22, 3],
    [7, 11],
    [15, 19],
  ]
  parts = partition.shards(np.arange(23) % 4, 5, 2, seed=0)
  d = _DEAL_SEED_0
  want = [sorted(shards[d[2 * j]] + shards[d[2 * j + 1]]) for j in range(5)]
  assert [p.tolist() for p in parts] == want
  assert [len(p) for p in parts] == [4, 5, 4, 5, 5]
  _check_disjoint_complete(parts, 23)


def test_shards_of_one_class_give_at_most_s_classes():
  # 4 classes of 8 in a shuffled order, 4 clients x 2 shards of 4: every
  # shard holds one class, so a client holds 1 or 2 classes, 4 or 8 of each.
  labels = np.random.default_rng(5).permutation(np.repeat(np.arange(4), 8))
  counts = set()
  for seed in range(20):
    parts = partition.shards(labels, 4, 2, seed)
    _check_disjoint_complete(parts, 32)
    for h in partition.summary(parts, labels, 4)['label_histograms']:
      assert sorted(h) in ([0, 0, 0, 8], [0, 0, 4, 4]), h
      counts.add(np.count_nonzero(h))
  assert counts == {1, 2}  # two shards of one class happen


def test_shards_seeded(labels):
  a = partition.shards(labels, 50, 2, seed=3)
  b = partition.shards(labels, 50, 2, seed=3)
  c = partition.shards(labels, 50, 2, seed=4)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))
  _check_disjoint_complete(a, len(labels))
  # 100 shards of 60 in classes of 600: no shard straddles.
  s = partition.summary(a, labels, 10)
  assert s['sizes'] == [120] * 50
  assert all(np.count_nonzero(h) <= 2 for h in s['label_histograms'])


def test_shards_bad_inputs(labels):
  with pytest.raises(errors.ArgumentError, match='^shards_per_client must'):
    partition.shards(labels, 10, 0, seed=0)
  with pytest.raises(
    errors.ArgumentError,
    match=r'^num_clients × `shards_per_client=2` = 6002 shards',
  ):
    partition.shards(labels, 3001, 2, seed=0)


def test_file_round_trip(tmp_path, labels):
  parts = partition.dirichlet(labels, 20, 0.5, seed=1)  # shuffled lists
  path = str(tmp_path / 'p.json')
  partition.save_file(path, parts)
  back, digest = partition.load_file(path, 20, num_examples=len(labels))
  assert len(back) == 20
  for got, want in zip(back, parts):
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, want)  # same order too
  with open(path, 'rb') as f:
    assert digest == hashlib.sha256(f.read()).hexdigest()
  assert partition.file_sha256(path) == digest
  assert list(json.load(open(path))) == ['clients']


def test_file_plain_list_and_left_out_examples(tmp_path):
  path = tmp_path / 'p.json'
  path.write_text('[[3, 1], [0]]')
  parts, _ = partition.load_file(str(path), 2, num_examples=5)
  assert [p.tolist() for p in parts] == [[3, 1], [0]]
  s = partition.summary(parts, np.array([0, 1, 0, 1, 0]), 2)
  assert s['sizes'] == [2, 1] and s['unassigned'] == 2


_GOOD = json.dumps([[0, 1], [2]])


@pytest.mark.parametrize(
  'content,fragment',
  [
    (None, 'cannot read it: No such file or directory'),
    ('dir', 'is a folder (a partition file is a regular JSON file'),
    # open() would wait for a writer
    ('fifo', 'is not a regular file (a FIFO)'),
    # read() would never end
    ('/dev/zero', 'is not a regular file (a character device)'),
    ('large', 'holds 13 bytes, more than the 8 allowed (a partition file'),
    ('[[0, 1], [2]', 'not JSON (Expecting'),
    (b'\xff\xfe\x00', 'not UTF-8 text (byte 0xff at offset 0)'),
    ('[' * 100_000, 'not JSON (nested too deeply)'),
    ('{"users": [[0]]}', 'without a "clients" key'),
    ('7', 'expected a list of client index lists'),
    ('{"clients": "0 1"}', 'got a string'),
    ('[]', 'got an empty list'),
    ('[[0], [1], [2]]', '3 clients, but `num_clients=2`; pass `num_clients=3`'),
    ('[[0], {"a": 1}]', 'client 1 is an object, not a list'),
    ('[[0], 5]', 'client 1 is a number, not a list'),
    ('[[0], []]', 'client 1 has no examples'),
    ('[[0, 1.0], [2]]', 'client 0 holds 1.0, not an integer'),
    ('[[0], [true]]', 'client 1 holds true, not an integer'),
    ('[[0], ["2"]]', 'client 1 holds "2", not an integer'),
    ('[[0], [null]]', 'client 1 holds null, not an integer'),
    ('[[0, -1], [2]]', 'client 0 holds index -1; indices start at 0'),
    ('[[0], [2, 10]]', 'client 1 holds index 10, out of range (the training'),
    ('[[0, 2], [1, 2]]', 'index 2 is in clients 0 and 1'),
    ('[[0, 1, 0], [2]]', 'index 0 is twice in client 0'),
  ],
)
def test_file_bad_contents_one_line_naming_it(
  tmp_path, monkeypatch, content, fragment
):
  path = tmp_path / 'p.json'
  if content == 'dir':
    path.mkdir()
  elif content == 'fifo':
    os.mkfifo(path)
  elif content == '/dev/zero':
    path = content
  elif content == 'large':
    monkeypatch.setattr(partition, 'MAX_FILE_BYTES', 8)
    path.write_text(_GOOD)  # 13 bytes
  elif isinstance(content, bytes):
    path.write_bytes(content)
  elif content is not None:
    path.write_text(content)
  with pytest.raises(partition.FileError) as e:
    partition.load_file(str(path), 2, num_examples=10)
  message = str(e.value)
  assert e.value.argument == 'path'
  assert message.startswith(f'path {path}: '), message
  assert fragment in e.value.reason
  assert '\n' not in message


def test_file_sha256_refuses_what_load_file_refuses(tmp_path, monkeypatch):
  # The config hashes the file before `load_file` checks it: a device or a
  # large file is an OSError there (the config then leaves the hash empty
  # and `load_file` names the problem), never a read of it.
  path = tmp_path / 'p.json'
  path.write_text(_GOOD)
  assert (
    partition.file_sha256(str(path))
    == hashlib.sha256(_GOOD.encode()).hexdigest()
  )
  with pytest.raises(OSError, match='/dev/zero: is not a regular file'):
    partition.file_sha256('/dev/zero')
  monkeypatch.setattr(partition, 'MAX_FILE_BYTES', len(_GOOD) - 1)
  with pytest.raises(OSError, match='holds 13 bytes, more than the 12'):
    partition.file_sha256(str(path))


def test_file_index_bound_before_the_dataset_is_known(tmp_path):
  path = tmp_path / 'p.json'
  path.write_text(json.dumps([[0], [2**31]]))
  with pytest.raises(partition.FileError, match=r'index 2147483648, out of'):
    partition.load_file(str(path), 2)
  path.write_text(json.dumps([[0], [2**31 - 1]]))
  parts, _ = partition.load_file(str(path), 2)
  assert parts[1].tolist() == [2**31 - 1]


def test_dirichlet_equal_sizes_disjoint_complete_seeded():
  labels = np.repeat(np.arange(5), 5000)
  parts = partition.dirichlet_equal(labels, 100, 0.1, seed=3)
  _check_disjoint_complete(parts, 25000)
  # Where the class-by-class split leaves clients nearly empty (5 classes,
  # 100 clients, α 0.1), every client holds exactly 250 examples.
  assert {len(p) for p in parts} == {250}
  again = partition.dirichlet_equal(labels, 100, 0.1, seed=3)
  assert all(np.array_equal(a, b) for a, b in zip(parts, again))
  other = partition.dirichlet_equal(labels, 100, 0.1, seed=4)
  assert not all(np.array_equal(a, b) for a, b in zip(parts, other))
  odd = partition.dirichlet_equal(labels[:1003], 10, 1.0, seed=0)
  _check_disjoint_complete(odd, 1003)
  assert [len(p) for p in odd] == [101, 101, 101] + [100] * 7


def test_dirichlet_equal_alpha_controls_the_classes_per_client():
  labels = np.repeat(np.arange(5), 5000)

  def classes(alpha):
    parts = partition.dirichlet_equal(labels, 100, alpha, seed=0)
    # Classes with at least a tenth of a client's examples, over the first
    # half (clients drawn while every class still has examples).
    counts = [np.bincount(labels[p], minlength=5) for p in parts[:50]]
    return np.mean([np.sum(c >= 25) for c in counts])

  # Measured: 1.72, 3.40 and 5.00.
  assert classes(0.1) < 2 < 3 < classes(1.0) < 4 < classes(100.0) == 5
  # α → 0: the first client's proportions are one-hot, so it holds one
  # class only.
  first = partition.dirichlet_equal(labels, 100, 1e-3, seed=0)[0]
  assert len(np.unique(labels[first])) == 1 and len(first) == 250


def test_dirichlet_equal_bad_inputs():
  with pytest.raises(errors.ArgumentError, match='^alpha must'):
    partition.dirichlet_equal(np.zeros(10, int), 2, 0.0, 0)


def test_sizes_between_draws_disjoint_clients_in_the_range():
  parts = partition.sizes_between(1000, 40, 10, 20, seed=3)
  sizes = np.array([len(p) for p in parts])
  assert len(parts) == 40 and sizes.min() >= 10 and sizes.max() <= 20
  assert len(set(sizes.tolist())) > 3  # drawn, not equal
  allidx = np.concatenate(parts)
  assert len(np.unique(allidx)) == len(allidx) == sizes.sum()
  assert allidx.min() >= 0 and allidx.max() < 1000
  again = partition.sizes_between(1000, 40, 10, 20, seed=3)
  assert all(np.array_equal(a, b) for a, b in zip(parts, again))
  # low == high: every client that size.
  assert {len(p) for p in partition.sizes_between(50, 5, 7, 7, 0)} == {7}


def test_sizes_between_refuses_before_drawing():
  with pytest.raises(errors.ArgumentError, match='^num_clients .* needs 200'):
    partition.sizes_between(199, 10, 10, 20, seed=0)
  with pytest.raises(
    errors.ArgumentError, match=r'^low must be in \[1, high\]'
  ):
    partition.sizes_between(1000, 10, 21, 20, seed=0)


def test_drawn_names_each_drawn_partition():
  labels = np.repeat(np.arange(10), 30)
  for kind, direct in [
    ('iid', partition.iid(300, 6, 3)),
    ('shards', partition.shards(labels, 6, 2, 3)),
    ('dirichlet_equal', partition.dirichlet_equal(labels, 6, 0.5, 3)),
    ('dirichlet', partition.dirichlet(labels, 6, 0.5, 3, min_size=5)),
  ]:
    got = partition.drawn(kind, labels, 6, 3, alpha=0.5, min_size=5)
    assert [p.tolist() for p in got] == [p.tolist() for p in direct], kind
  with pytest.raises(errors.ArgumentError, match='kind'):
    partition.drawn('file', labels, 6, 3)
