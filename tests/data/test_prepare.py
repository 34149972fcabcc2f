"""`fedjax_mr.data.prepare` (with `femnist`, `shakespeare`, `leaf`'s
writing and `cinic.unpack`) and `experiments.prepare`, offline: tiny
archives in the sources' real formats (NIST SD19 zips of 128×128 PNGs,
Gutenberg's 1994 text in a zip, the CINIC-10 tarball) go through the real
conversion and are read back with `datasets.load`; tfds's builder is a fake
that writes files. `download` has its own tests (test_download.py)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import types
import urllib.request
import zipfile

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from fedjax_mr.core import errors
from fedjax_mr.data import cinic
from fedjax_mr.data import client_data
from fedjax_mr.data import datasets
from fedjax_mr.data import download
from fedjax_mr.data import femnist
from fedjax_mr.data import leaf
from fedjax_mr.data import prepare
from fedjax_mr.data import shakespeare
from tests import helpers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))

# ------------------------------------------------------------------ sources --


def _png(pixels: np.ndarray, mode: str) -> bytes:
  buf = io.BytesIO()
  Image.fromarray(pixels).convert(mode).save(buf, 'PNG')
  return buf.getvalue()


def _nist_image(k: int) -> np.ndarray:
  """A unique 128×128 bilevel image: white, one black square at k."""
  image = np.full((128, 128), 255, np.uint8)
  row, col = divmod(k, 8)
  image[8 + 14 * row : 20 + 14 * row, 8 + 14 * col : 20 + 14 * col] = 0
  return image


def _shrunk(image: np.ndarray) -> np.ndarray:
  """The 28×28 image LEAF makes of a NIST PNG (resize with Lanczos)."""
  grey = Image.open(io.BytesIO(_png(image, '1'))).convert('L')
  return np.asarray(grey.resize((28, 28), Image.Resampling.LANCZOS))


# writer → [(NIST class folder, its LEAF label)] of the writer's images.
WRITERS = {
  'f0000_14': [('30', 0), ('39', 9), ('41', 10), ('4a', 19), ('61', 36)],
  'f0001_41': [('5a', 35), ('7a', 61), ('30', 0)],
  'f0002_03': [('41', 10), ('61', 36)],
  'f0003_07': [('39', 9)],  # one sample: LEAF's split drops the writer
}


def write_nist(folder) -> tuple[dict, dict]:
  """Writes by_class.zip and by_write.zip of `WRITERS`.

  Returns:
    ({file name: path}, {writer: [(label, 28×28 expected image)]}).
  """
  os.makedirs(folder, exist_ok=True)
  by_class = os.path.join(folder, 'by_class.zip')
  by_write = os.path.join(folder, 'by_write.zip')
  expected = {}
  k = 0
  with (
    zipfile.ZipFile(by_class, 'w') as zc,
    zipfile.ZipFile(by_write, 'w') as zw,
  ):
    for w, (writer, images) in enumerate(WRITERS.items()):
      expected[writer] = []
      part = f'hsf_{w % 2}'
      for i, (cls, label) in enumerate(images):
        if k == 0:
          image = np.full((128, 128), 255, np.uint8)  # all white
        elif k == 1:
          image = np.zeros((128, 128), np.uint8)  # all black
        else:
          image = _nist_image(k)
        png = _png(image, '1')
        zc.writestr(f'by_class/{cls}/{part}/{part}_{k:05d}.png', png)
        zw.writestr(
          f'by_write/{part}/{writer}/t{writer[1:]}/t{writer[1:]}_{i:05d}.png',
          png,
        )
        expected[writer].append((label, _shrunk(image)))
        k += 1
    # Not images of LEAF's: a .mit file, and a train_30/ folder holding a
    # copy of an upper-case 'A' (41) image that sorts before by_class/41.
    zc.writestr('by_class/30/hsf_0.mit', b'2\nfile list\n')
    twin = _png(_nist_image(2), '1')  # f0000_14's third image, class 41
    zc.writestr('by_class/30/train_30/train_30_00000.png', twin)
  return {'by_class.zip': by_class, 'by_write.zip': by_write}, expected


SHAKESPEARE_TEXT = [
  'The Project Gutenberg Etext of Shakespeare (a first line, skipped)',
  'THE SONNETS',
  '',
  'by William Shakespeare',
  '',
  '  1',
  '  From fairest creatures we desire increase,',
  '',
  'THE TRAGEDY OF TESTING',
  '',
  'by William Shakespeare',
  '',
  'Dramatis Personae',
  '',
  '  HAMLET. To be, or not  to be:',
  '    that is the question.',
  '  OPHELIA. My lord?',
  '  HAMLET. Nothing.',
  '  OPHELIA. Good my lord,',
  '    how does your honour?',
  '  Ghost. Remember me.',
  '  ophelia. Fare you well.',
  '  [Exit]',
  '',
  'THE LONELY PLAY',
  '',
  'by William Shakespeare',
  '',
  '  SOLO. One.',
  '    Two.',
  '    Three.',
  '',
  'THE COMEDY OF ERRORS',
  '',
  'by William Shakespeare',
  '',
  'ACT I. SCENE 1.',
  'DROMIO. Hello there.',
  'second line',
  '<<notice>>',
  'more notice text',
  'ANGELO. Sir.',
  'ANGELO. Sir, again.',
  'A third.',
  'DROMIO. Bye.',
]
# What LEAF makes of it: users (characters with more than two lines, of
# plays with more than one character) and their lines, double spaces as one.
SHAKESPEARE_USERS = {
  'THE_TRAGEDY_OF_TESTING_HAMLET': [
    'To be, or not to be:',
    'that is the question.',
    'Nothing.',
  ],
  'THE_TRAGEDY_OF_TESTING_OPHELIA': [
    'My lord?',
    'Good my lord,',
    'how does your honour?',
    'Fare you well.',
  ],
  'THE_COMEDY_OF_ERRORS_DROMIO': ['Hello there.', 'second line', 'Bye.'],
  'THE_COMEDY_OF_ERRORS_ANGELO': ['Sir.', 'Sir, again.', 'A third.'],
}


def write_gutenberg(folder, lines=SHAKESPEARE_TEXT) -> dict:
  """1994-01-100.zip holding 100.txt with DOS line ends, as in 1994."""
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, '1994-01-100.zip')
  with zipfile.ZipFile(path, 'w') as z:
    z.writestr('100.txt', '\r\n'.join(lines) + '\r\n')
  return {'1994-01-100.zip': path}


def write_cinic_tar(folder, top=None, per_class=2, seed=0) -> tuple:
  """CINIC-10.tar.gz: <split>/<class>/*.png of 32×32 RGB (one grey).

  Returns:
    ({file name: path}, {split: (x, y)} in the loader's order).
  """
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, 'CINIC-10.tar.gz')
  rng = np.random.default_rng(seed)
  arrays = {}
  with tarfile.open(path, 'w:gz') as tar:
    for split in ('train', 'valid', 'test'):
      xs, ys = [], []
      for label, name in enumerate(cinic.CLASSES):
        for i in range(per_class):
          if split == 'train' and label == 3 and i == 0:
            grey = rng.integers(0, 256, (32, 32), dtype=np.uint8)
            png, rgb = _png(grey, 'L'), np.repeat(grey[..., None], 3, -1)
          else:
            rgb = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            png = _png(rgb, 'RGB')
          member = f'{split}/{name}/cifar10-{split}-{i}.png'
          if top:
            member = f'{top}/{member}'
          info = tarfile.TarInfo(member)
          info.size = len(png)
          tar.addfile(info, io.BytesIO(png))
          xs.append(rgb)
          ys.append(label)
      arrays[split] = (np.stack(xs), np.asarray(ys))
  return {'CINIC-10.tar.gz': path}, arrays


def copying_fetch(files: dict, calls: list):
  """A `download` that copies the fixture named like the target."""

  def fetch(url, path, *, md5=None, sha256=None):
    calls.append(url)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    shutil.copyfile(files[os.path.basename(path)], path)

  return fetch


def _quiet(line):
  del line


def _prepare(name, root, files, calls=None, **kw):
  calls = [] if calls is None else calls
  fetch = copying_fetch(files, calls)
  return prepare.prepare(name, str(root), fetch=fetch, log=_quiet, **kw)


def _snapshot(root) -> dict:
  out = {}
  for folder, _, names in os.walk(root):
    for n in names:
      path = os.path.join(folder, n)
      with open(path, 'rb') as f:
        digest = hashlib.sha256(f.read()).hexdigest()
      out[os.path.relpath(path, root)] = (os.stat(path).st_mtime_ns, digest)
  return out


# ------------------------------------------------------------------ FEMNIST --


def test_femnist_labels_are_leafs():
  # NIST's class folders are hex ASCII codes: '0'-'9', 'A'-'Z', 'a'-'z'
  # are LEAF's labels 0-61 in this order.
  chars = '0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz'
  folders = [f'{ord(c):x}' for c in chars]
  assert folders[:2] == ['30', '31'] and folders[-1] == '7a'
  assert [femnist.label(f) for f in folders] == list(range(62))
  for bad in ('zz', '2f', '3a', '40', '5b', '7b'):
    with pytest.raises(errors.DataError, match='not a NIST class'):
      femnist.label(bad)


def test_femnist_from_nist_zips_loads_with_writers_as_clients(
  tmp_path, monkeypatch
):
  files, expected = write_nist(tmp_path / 'src')
  monkeypatch.setattr(femnist, 'WRITERS_PER_FILE', 2)  # two json files
  calls = []
  result = _prepare('femnist', tmp_path / 'd', files, calls)
  dest = os.path.join(tmp_path, 'd', 'leaf', 'femnist', 'data')
  assert result.path == result.data_dir == dest and not result.skipped
  assert result.size == prepare.disk_size(dest) > 0
  assert sorted(os.path.basename(u) for u in calls) == [
    'by_class.zip',
    'by_write.zip',
  ]
  assert sorted(os.listdir(os.path.join(dest, 'train'))) == [
    'all_data_000_train.json',
    'all_data_001_train.json',
  ]
  ds = datasets.load('femnist', dest)
  # Writers in sorted order; the one with a single sample is dropped;
  # LEAF's split: max(1, int(0.9 n)) training samples, 1 of 2.
  assert [len(c) for c in ds.clients] == [4, 2, 1]
  assert [len(c) for c in ds.test_clients] == [1, 1, 1]
  assert ds.x_train.shape == (7, 28, 28, 1) and ds.x_test.shape == (
    3,
    28,
    28,
    1,
  )
  for k, writer in enumerate(['f0000_14', 'f0001_41', 'f0002_03']):
    x = np.concatenate(
      [ds.x_train[ds.clients[k]], ds.x_test[ds.test_clients[k]]]
    )[..., 0]
    y = np.concatenate(
      [ds.y_train[ds.clients[k]], ds.y_test[ds.test_clients[k]]]
    )
    got = sorted((int(label), img.tobytes()) for label, img in zip(y, x))
    want = sorted((label, img.tobytes()) for label, img in expected[writer])
    assert got == want, writer
  # The all-white image stays 255 (x = 1.0 in LEAF), model input -1.
  white = np.concatenate([ds.x_train, ds.x_test])
  white = white[(white == 255).all(axis=(1, 2, 3))]
  assert len(white) == 1
  helpers.assert_close(
    np.asarray(client_data.normalize(white, ds.scale, ds.shift)), -1.0
  )
  # The papers' filter is the loader's: writers with > 2 samples (5, 3).
  assert len(datasets.load('femnist', dest, leaf_min_samples=2).clients) == 2


def test_femnist_json_is_leafs_format(tmp_path):
  files, _ = write_nist(tmp_path / 'src')
  dest = _prepare('femnist', tmp_path / 'd', files).path
  with open(os.path.join(dest, 'test', 'all_data_000_test.json')) as f:
    text = f.read()
  assert text.startswith('{"users": ["f0000_14", "f0001_41", "f0002_03"], ')
  doc = json.loads(text)
  assert list(doc) == ['users', 'num_samples', 'user_data']
  assert doc['num_samples'] == [1, 1, 1]
  x = doc['user_data']['f0000_14']['x'][0]
  assert len(x) == 784 and all(v * 255 == round(v * 255) for v in x)


def test_a_writer_image_without_a_by_class_twin_fails_cleanly(tmp_path):
  files, _ = write_nist(tmp_path / 'src')
  with zipfile.ZipFile(files['by_write.zip'], 'a') as z:
    z.writestr(
      'by_write/hsf_0/f0000_14/t0000_14/t0000_14_00099.png',
      _png(_nist_image(40), '1'),
    )
  with pytest.raises(errors.DataError, match='t0000_14_00099.png has no'):
    _prepare('femnist', tmp_path / 'd', files)
  dest = os.path.join(tmp_path, 'd', 'leaf', 'femnist', 'data')
  assert not os.path.exists(dest) and not os.path.exists(dest + '.partial')


def test_the_split_is_leafs_seeded_sample():
  # LEAF's split_data.py --by_sample, one random.Random over all users.
  sizes, fraction, seed = [1, 2, 3, 10, 57, 0, 5], 0.9, 7
  rng = random.Random(seed)
  want = []
  for n in sizes:
    if n >= 2:
      k = max(1, int(fraction * n))
      if n == 2:
        k = 1
      want.append(sorted(rng.sample([j for j in range(n)], k)))
    else:
      want.append(None)
  rng = random.Random(seed)
  got = []
  for n in sizes:
    mask = leaf.train_mask(n, fraction, rng)
    got.append(None if mask is None else np.flatnonzero(mask).tolist())
  assert got == want
  assert [len(g) if g else 0 for g in got] == [0, 1, 2, 9, 51, 0, 4]


# -------------------------------------------------------------- Shakespeare --


def _windows(line):
  padded = ' ' * 80 + line
  return [(padded[i : i + 80], padded[i + 80]) for i in range(len(line))]


def test_shakespeare_plays_and_users_are_leafs():
  text = '\n'.join(SHAKESPEARE_TEXT) + '\n'
  plays = shakespeare.parse_plays(text)
  assert [title for title, _ in plays] == [
    'THE TRAGEDY OF TESTING',
    'THE COMEDY OF ERRORS',
  ]  # THE LONELY PLAY has one character
  assert list(plays[0][1]) == ['HAMLET', 'OPHELIA', 'GHOST']
  users = shakespeare.user_lines(plays)
  lines = {u: shakespeare.clean_lines(v) for u, v in users.items()}
  assert lines == {
    u: [s + '\n' for s in v] for u, v in SHAKESPEARE_USERS.items()
  }
  xs, ys = shakespeare.windows(['ab\n'])
  assert xs == [' ' * 80, ' ' * 79 + 'a', ' ' * 78 + 'ab']
  assert ys == ['a', 'b', '\n']


def test_shakespeare_from_gutenberg_zip_loads_with_roles_as_clients(tmp_path):
  files = write_gutenberg(tmp_path / 'src')
  result = _prepare('shakespeare', tmp_path / 'd', files)
  dest = os.path.join(tmp_path, 'd', 'leaf', 'shakespeare', 'data')
  assert result.path == dest
  ds = datasets.load('shakespeare', dest)
  # Samples per role: one per character of each line with its newline:
  # HAMLET 21 + 22 + 9 = 52, OPHELIA 9 + 14 + 22 + 15 = 60, DROMIO
  # 13 + 12 + 5 = 30, ANGELO 5 + 12 + 9 = 26; 90 % of each train.
  totals = [52, 60, 30, 26]
  assert [
    sum(len(s) + 1 for s in v) for v in SHAKESPEARE_USERS.values()
  ] == totals
  assert [len(c) for c in ds.clients] == [46, 54, 27, 23]
  assert [len(c) for c in ds.test_clients] == [6, 6, 3, 3]
  assert ds.x_train.shape == (150, 80) and ds.x_test.shape == (18, 80)
  letters = np.array(list(leaf.ALL_LETTERS))
  for k, spoken in enumerate(SHAKESPEARE_USERS.values()):
    rows = [
      (ds.x_train, ds.y_train, ds.clients[k]),
      (ds.x_test, ds.y_test, ds.test_clients[k]),
    ]
    got = sorted(
      (''.join(letters[x[i]]), str(letters[y[i]]))
      for x, y, idx in rows
      for i in idx
    )
    want = sorted(w for s in spoken for w in _windows(s + '\n'))
    assert got == want
  with open(os.path.join(dest, 'train', 'all_data_train.json')) as f:
    users = json.loads(f.read())['users']
  assert users == list(SHAKESPEARE_USERS)


def test_shakespeare_outside_the_vocabulary_fails_cleanly(tmp_path):
  lines = [*SHAKESPEARE_TEXT]
  lines[lines.index('    that is the question.')] = (
    '    that | is the question.'
  )
  files = write_gutenberg(tmp_path / 'src', lines)
  with pytest.raises(errors.DataError, match=r"vocabulary: \['\|'\]"):
    _prepare('shakespeare', tmp_path / 'd', files)
  dest = os.path.join(tmp_path, 'd', 'leaf', 'shakespeare', 'data')
  assert not os.path.exists(dest) and not os.path.exists(dest + '.partial')


def test_not_the_1994_text_fails(tmp_path):
  files = write_gutenberg(tmp_path / 'src', ['just', 'some', 'text'])
  with pytest.raises(errors.DataError, match='no play found'):
    _prepare('shakespeare', tmp_path / 'd', files)


# ----------------------------------------------------------------- CINIC-10 --


@pytest.mark.parametrize('top', [None, 'CINIC-10'])
def test_cinic10_from_tarball_loads(tmp_path, top):
  files, arrays = write_cinic_tar(tmp_path / 'src', top)
  result = _prepare('cinic10', tmp_path / 'd', files)
  dest = os.path.join(tmp_path, 'd', 'cinic10')
  assert result.path == result.data_dir == dest
  assert sorted(os.listdir(dest)) == ['test', 'train', 'valid']
  ds = datasets.load('cinic10', dest)
  assert ds.x_train.shape == (20, 32, 32, 3) and ds.x_test.shape == (
    20,
    32,
    32,
    3,
  )
  np.testing.assert_array_equal(ds.y_train, np.repeat(np.arange(10), 2))
  np.testing.assert_array_equal(ds.x_train, arrays['train'][0])
  np.testing.assert_array_equal(ds.x_test, arrays['test'][0])
  np.testing.assert_array_equal(ds.y_test, arrays['test'][1])


def test_an_unsafe_or_wrong_tarball_fails_cleanly(tmp_path):
  path = tmp_path / 'src' / 'CINIC-10.tar.gz'
  os.makedirs(path.parent)
  with tarfile.open(path, 'w:gz') as tar:
    info = tarfile.TarInfo('../escaped.png')
    info.size = 3
    tar.addfile(info, io.BytesIO(b'png'))
  files = {'CINIC-10.tar.gz': str(path)}
  with pytest.raises(errors.DataError, match='not a readable CINIC-10.*anew'):
    _prepare('cinic10', tmp_path / 'd', files)
  assert not os.path.exists(tmp_path / 'd' / 'escaped.png')
  assert not os.path.exists(tmp_path / 'd' / 'cinic10')
  assert not os.path.exists(tmp_path / 'd' / 'cinic10.partial')
  os.remove(tmp_path / 'd' / 'downloads' / 'CINIC-10.tar.gz')  # as it says
  with tarfile.open(path, 'w:gz') as tar:  # a link (to a file outside)
    info = tarfile.TarInfo('train/cat/a.png')
    info.type, info.linkname = tarfile.SYMTYPE, '/etc/passwd'
    tar.addfile(info)
  with pytest.raises(errors.DataError, match='not a folder or a regular file'):
    _prepare('cinic10', tmp_path / 'd', files)
  assert not os.path.exists(tmp_path / 'd' / 'cinic10.partial')
  os.remove(tmp_path / 'd' / 'downloads' / 'CINIC-10.tar.gz')
  with tarfile.open(path, 'w:gz') as tar:  # not CINIC-10's layout
    info = tarfile.TarInfo('train/cat/a.png')
    info.size = 3
    tar.addfile(info, io.BytesIO(b'png'))
  with pytest.raises(errors.DataError, match='class folders'):
    _prepare('cinic10', tmp_path / 'd', files)
  assert not os.path.exists(tmp_path / 'd' / 'cinic10')


# ------------------------------------------------ idempotence and failures --


def _all_sources(folder):
  files, _ = write_nist(folder)
  files.update(write_gutenberg(folder))
  files.update(write_cinic_tar(folder)[0])
  return files


def test_a_second_run_skips_and_changes_nothing(tmp_path):
  files = _all_sources(tmp_path / 'src')
  calls = []
  names = ('femnist', 'shakespeare', 'cinic10')
  first = [_prepare(n, tmp_path / 'd', files, calls) for n in names]
  assert not any(r.skipped for r in first) and len(calls) == 4
  before = _snapshot(tmp_path / 'd')
  lines = []
  fetch = copying_fetch(files, calls)
  second = [
    prepare.prepare(n, str(tmp_path / 'd'), fetch=fetch, log=lines.append)
    for n in names
  ]
  assert all(r.skipped for r in second) and len(calls) == 4
  assert [r.path for r in second] == [r.path for r in first]
  assert [r.size for r in second] == [r.size for r in first]
  assert lines == [
    f'{n}: already prepared in {r.path}, skipping' for n, r in zip(names, first)
  ]
  assert _snapshot(tmp_path / 'd') == before


def test_a_failed_download_leaves_nothing_half_written(tmp_path):
  files, _ = write_nist(tmp_path / 'src')
  calls = []

  def broken(url, path, *, md5=None, sha256=None):
    calls.append(url)
    if path.endswith('by_write.zip'):
      with open(path + '.part', 'wb') as f:  # what `download` leaves
        f.write(b'PK\x03\x04 half')
      raise errors.DataError(f'{url}: the download stopped after 9 B')
    os.makedirs(os.path.dirname(path), exist_ok=True)
    shutil.copyfile(files[os.path.basename(path)], path)

  with pytest.raises(errors.DataError, match='stopped after 9 B.*by hand'):
    prepare.prepare('femnist', str(tmp_path / 'd'), fetch=broken, log=_quiet)
  downloads = tmp_path / 'd' / 'downloads'
  assert sorted(os.listdir(downloads)) == ['by_class.zip', 'by_write.zip.part']
  assert not os.path.exists(tmp_path / 'd' / 'leaf')
  with pytest.raises(errors.DataError, match='not a readable folder'):
    datasets.load('femnist', str(tmp_path / 'd' / 'leaf' / 'femnist' / 'data'))

  # A download that fails before writing anything leaves no folder.
  def offline(url, path, *, md5=None, sha256=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)  # as `download` does
    raise errors.DataError(f'{url}: no network')

  with pytest.raises(errors.DataError, match='no network'):
    prepare.prepare('cinic10', str(tmp_path / 'e'), fetch=offline, log=_quiet)
  assert not os.path.exists(tmp_path / 'e')
  # The next run downloads only what is missing.
  calls.clear()
  result = _prepare('femnist', tmp_path / 'd', files, calls)
  assert [os.path.basename(u) for u in calls] == ['by_write.zip']
  assert len(datasets.load('femnist', result.path).clients) == 3


def test_downloads_are_reused_and_deleted_when_asked(tmp_path):
  files = write_gutenberg(tmp_path / 'src')
  downloads = tmp_path / 'd' / 'downloads'
  os.makedirs(downloads)
  shutil.copy(files['1994-01-100.zip'], downloads)  # put there by hand
  calls = []
  _prepare('shakespeare', tmp_path / 'd', files, calls, keep_downloads=False)
  assert calls == [] and os.listdir(downloads) == []


def test_a_foreign_folder_in_the_way_is_not_overwritten(tmp_path):
  dest = tmp_path / 'd' / 'cinic10'
  os.makedirs(dest)
  (dest / 'notes.txt').write_text('mine')
  files, _ = write_cinic_tar(tmp_path / 'src')
  with pytest.raises(errors.DataError, match='holds no prepared cinic10'):
    _prepare('cinic10', tmp_path / 'd', files)
  assert os.listdir(dest) == ['notes.txt']


def test_bad_options():
  with pytest.raises(errors.ArgumentError, match="^name 'im.*' is unknown"):
    prepare.prepare('imagenet', log=_quiet)
  with pytest.raises(errors.ArgumentError, match='^train_fraction must'):
    prepare.prepare('femnist', train_fraction=1.0, log=_quiet)
  with pytest.raises(errors.ArgumentError, match='^seed must'):
    prepare.prepare('femnist', seed=-1, log=_quiet)


# --------------------------------------------------------------------- tfds --


class FakeBuilder:
  """tfds's builder as `prepare` uses it; prepared = its files exist."""

  calls: list = []
  downloads: list = []  # (download_dir, manual_dir) of each build
  default_dir = ''

  def __init__(self, name, data_dir=None):
    self.name = name
    self.root = data_dir or self.default_dir
    self.data_dir = os.path.join(self.root, *name.split('/'), '1.0.0')
    archive = name.replace('/', '_') + '.tar.gz'
    self.url_infos = {
      f'https://example.org/{archive}': types.SimpleNamespace(filename=archive)
    }

  def is_prepared(self):
    return os.path.exists(os.path.join(self.data_dir, 'dataset_info.json'))

  @property
  def info(self):
    with open(os.path.join(self.data_dir, 'dataset_info.json')) as f:
      fmt = json.load(f)['fileFormat']
    return types.SimpleNamespace(file_format=types.SimpleNamespace(value=fmt))

  def download_and_prepare(
    self, *, file_format, download_dir=None, download_config=None
  ):
    self.calls.append((self.name, self.root, file_format))
    manual = download_config.manual_dir if download_config else None
    self.downloads.append((download_dir, manual))
    os.makedirs(self.data_dir)
    with open(os.path.join(self.data_dir, 'dataset_info.json'), 'w') as f:
      json.dump({'fileFormat': str(file_format)}, f)
    with open(os.path.join(self.data_dir, 'train.array_record-0'), 'wb') as f:
      f.write(bytes(1000))


@pytest.fixture
def fake_tfds(tmp_path, monkeypatch):
  FakeBuilder.calls = []
  FakeBuilder.downloads = []
  FakeBuilder.default_dir = str(tmp_path / 'tfds_default')
  monkeypatch.setattr(tfds, 'builder', FakeBuilder)
  monkeypatch.setattr(prepare, '_has_module', lambda name: True)
  monkeypatch.setattr(prepare, '_resolves', lambda host: True)
  return FakeBuilder


def test_tfds_datasets_are_built_as_array_record(tmp_path, fake_tfds):
  result = prepare.prepare('emnist', str(tmp_path / 'd'), log=_quiet)
  assert fake_tfds.calls == [
    ('emnist/byclass', str(tmp_path / 'd'), 'array_record')
  ]
  assert result.path == str(tmp_path / 'd' / 'emnist' / 'byclass' / '1.0.0')
  assert result.data_dir == str(tmp_path / 'd') and not result.skipped
  assert result.size > 1000
  again = prepare.prepare('emnist', str(tmp_path / 'd'), log=_quiet)
  assert again.skipped and len(fake_tfds.calls) == 1
  # Without --data_dir: tfds's default dir, and a run needs no --data_dir.
  result = prepare.prepare('cifar100', log=_quiet)
  assert fake_tfds.calls[-1] == (
    'cifar100',
    fake_tfds.default_dir,
    'array_record',
  )
  assert result.data_dir == ''


def test_a_tfds_dataset_in_another_format_is_named(tmp_path, fake_tfds):
  builder = FakeBuilder('cifar10', str(tmp_path))
  builder.download_and_prepare(file_format='tfrecord')
  with pytest.raises(errors.DataError, match='as tfrecord files.*convert_f'):
    prepare.prepare('cifar10', str(tmp_path), log=_quiet)


def test_a_tfds_failure_is_one_line(tmp_path, fake_tfds, monkeypatch):
  def fail(self, **kwargs):
    os.makedirs(os.path.join(self.data_dir + '.incomplete', 'x'))
    os.makedirs(kwargs['download_dir'])
    raise ConnectionError('Max retries exceeded\nwith url: cifar ' + 'x' * 300)

  monkeypatch.setattr(FakeBuilder, 'download_and_prepare', fail)
  monkeypatch.chdir(tmp_path)
  with pytest.raises(errors.DataError) as e:
    prepare.prepare('cifar10', log=_quiet)
  message = str(e.value)
  assert 'ConnectionError: Max retries exceeded with url' in message
  assert '\n' not in message and len(message) < 500
  # Where a hand-downloaded archive goes: the folder tfds is told to look in.
  assert message.endswith(
    'put cifar10.tar.gz (from https://example.org/cifar10.tar.gz) in '
    'data/downloads by hand'
  )
  # Nothing it created is left: not tfds's default data dir (the user's
  # ~/tensorflow_datasets), not data/downloads.
  assert not os.path.exists(fake_tfds.default_dir)
  assert os.listdir(tmp_path) == []
  # What existed before stays.
  os.makedirs(tmp_path / 'data' / 'downloads' / 'mine')
  os.makedirs(os.path.join(fake_tfds.default_dir, 'mnist'))
  with pytest.raises(errors.DataError):
    prepare.prepare('cifar10', log=_quiet)
  assert os.listdir(fake_tfds.default_dir) == ['mnist']
  assert os.listdir(tmp_path / 'data' / 'downloads') == ['mine']


def test_offline_a_tfds_dataset_fails_at_once(tmp_path, fake_tfds, monkeypatch):
  # tfds would retry each archive for minutes (10 min for the three tfds
  # datasets here); a host name that does not resolve fails it at once.
  looked_up = []

  def offline(host):
    looked_up.append(host)
    return False

  monkeypatch.setattr(prepare, '_resolves', offline)
  monkeypatch.setattr(urllib.request, 'getproxies', lambda: {})
  monkeypatch.chdir(tmp_path)
  with pytest.raises(errors.DataError) as e:
    prepare.prepare('cifar10', log=_quiet)
  assert str(e.value) == (
    'cifar10: cannot look up example.org (no internet access?); run again '
    'once it can, or put cifar10.tar.gz (from '
    'https://example.org/cifar10.tar.gz) in data/downloads by hand'
  )
  assert looked_up == ['example.org'] and fake_tfds.calls == []
  assert os.listdir(tmp_path) == []  # nothing created
  # An archive put there by hand is built from, without a lookup.
  os.makedirs(tmp_path / 'data' / 'downloads')
  (tmp_path / 'data' / 'downloads' / 'cifar10.tar.gz').write_bytes(b'x')
  prepare.prepare('cifar10', log=_quiet)
  assert looked_up == ['example.org'] and len(fake_tfds.calls) == 1
  # Behind a proxy, which resolves the names itself: no lookup either.
  monkeypatch.setattr(
    urllib.request, 'getproxies', lambda: {'https': 'http://proxy:3128'}
  )
  prepare.prepare('cifar100', log=_quiet)
  assert looked_up == ['example.org'] and len(fake_tfds.calls) == 2


def test_tfds_downloads_go_beside_the_others_and_bars_only_to_a_terminal(
  tmp_path, fake_tfds, monkeypatch
):
  disabled = []
  monkeypatch.setattr(tfds, 'disable_progress_bar', lambda: disabled.append(1))
  monkeypatch.setattr(sys.stderr, 'isatty', lambda: False)
  prepare.prepare('cifar10', str(tmp_path / 'd'), log=_quiet)
  downloads = str(tmp_path / 'd' / 'downloads')
  assert fake_tfds.downloads == [(os.path.join(downloads, 'tfds'), downloads)]
  assert disabled == [1]
  monkeypatch.setattr(sys.stderr, 'isatty', lambda: True)
  prepare.prepare('cifar100', str(tmp_path / 'd'), log=_quiet)
  assert disabled == [1]
  # --nokeep_downloads: tfds's own downloads go too.
  os.makedirs(os.path.join(downloads, 'tfds', 'extracted'))
  prepare.prepare(
    'emnist', str(tmp_path / 'd'), keep_downloads=False, log=_quiet
  )
  assert os.listdir(downloads) == []


def test_missing_tensorflow_is_said_before_anything_starts(
  tmp_path, fake_tfds, monkeypatch
):
  monkeypatch.setattr(prepare, '_has_module', lambda name: name != 'tensorflow')
  names = ['cifar10', 'femnist', 'emnist']
  with pytest.raises(errors.DataError) as e:
    prepare.check_requirements(names, str(tmp_path))
  message = str(e.value)
  assert message.startswith('preparing cifar10, emnist needs TensorFlow ')
  assert "pip install 'fedjax_mr[prepare]'" in message
  assert 'importlib_resources' not in message
  with pytest.raises(errors.DataError, match='needs TensorFlow'):
    prepare.prepare('cifar10', str(tmp_path), log=_quiet)
  assert fake_tfds.calls == [] and not os.listdir(tmp_path)
  # Prepared ones need nothing; nor do the others.
  FakeBuilder('cifar10', str(tmp_path)).download_and_prepare(
    file_format='array_record'
  )
  FakeBuilder('emnist/byclass', str(tmp_path)).download_and_prepare(
    file_format='array_record'
  )
  prepare.check_requirements(names, str(tmp_path))
  prepare.check_requirements(['femnist', 'cinic10'], str(tmp_path))


# ------------------------------------------------------------------ program --


def _run(args, cwd=REPO):
  return subprocess.run(
    [sys.executable, *args],
    cwd=cwd,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, 'PYTHONPATH': REPO},
  )


def test_the_program_prepares_offline_then_skips(tmp_path):
  data = tmp_path / 'data'
  downloads = data / 'downloads'
  for path in _all_sources(tmp_path / 'src').values():
    os.makedirs(downloads, exist_ok=True)
    shutil.copy(path, downloads)  # an offline machine, given the archives
  args = [
    '-m',
    'experiments.prepare',
    '--datasets=shakespeare,cinic10,femnist',
    f'--data_dir={data}',
  ]
  first = _run(args)
  assert first.returncode == 0, first.stderr
  assert 'Traceback' not in first.stderr
  places = (
    ('shakespeare', data / 'leaf' / 'shakespeare' / 'data'),
    ('cinic10', data / 'cinic10'),
    ('femnist', data / 'leaf' / 'femnist' / 'data'),
  )
  for name, where in places:
    summary = first.stdout.split('\nDatasets:\n')[1].splitlines()
    line = next(x for x in summary if x.startswith(name + ' '))
    assert line.endswith(
      f'  {where}  (prepared; run with --dataset={name} --data_dir={where})'
    )
    assert f'{name}: prepared in {where} (' in first.stdout
  second = _run(args)
  assert second.returncode == 0, second.stderr
  assert second.stdout.count('already prepared in') == 3
  # The summary: one line per dataset, names and sizes aligned.
  summary = second.stdout.split('\nDatasets:\n')[1].splitlines()
  for line, (name, where) in zip(summary, places):
    size = download.human_size(prepare.disk_size(where))
    assert line == (
      f'{name:<11}  {size:>8}  {where}  (already there; run with '
      f'--dataset={name} --data_dir={where})'
    )


def test_the_program_says_a_tfds_run_needs_no_data_dir(tmp_path):
  code = (
    'import sys\n'
    'import tensorflow_datasets as tfds\n'
    'from tests.data import test_prepare\n'
    f"test_prepare.FakeBuilder.default_dir = '{tmp_path}/tfds'\n"
    'tfds.builder = test_prepare.FakeBuilder\n'
    'from fedjax_mr.data import prepare\n'
    'prepare._has_module = lambda name: True\n'
    'prepare._resolves = lambda host: True\n'
    'from experiments import prepare as program\n'
    "sys.argv = ['prepare', '--datasets=cifar100']\n"
    'program.entry()\n'
  )
  proc = _run(['-c', code])
  assert proc.returncode == 0, proc.stderr
  path = tmp_path / 'tfds' / 'cifar100' / '1.0.0'
  assert proc.stdout.endswith(
    f'  {path}  (prepared; run with --dataset=cifar100 (no --data_dir))\n'
  )


def test_the_program_without_tensorflow_says_so_in_one_line(tmp_path):
  code = (
    'import sys\n'
    'from fedjax_mr.data import prepare\n'
    "prepare._has_module = lambda name: name != 'tensorflow'\n"
    'from experiments import prepare as program\n'
    f"sys.argv = ['prepare', '--datasets=cinic10,cifar10', "
    f"'--data_dir={tmp_path}/d']\n"
    'program.entry()\n'
  )
  proc = _run(['-c', code])
  assert proc.returncode == 2
  lines = [x for x in proc.stderr.splitlines() if x.strip()]
  assert len(lines) == 1, proc.stderr
  assert lines[0].startswith('error: preparing cifar10 needs TensorFlow ')
  assert "pip install 'fedjax_mr[prepare]'" in lines[0]
  assert not os.path.exists(tmp_path / 'd')


def test_the_program_goes_on_past_a_failed_dataset(tmp_path):
  data = tmp_path / 'data'
  os.makedirs(data / 'downloads')
  files, _ = write_cinic_tar(tmp_path / 'src')
  shutil.copy(files['CINIC-10.tar.gz'], data / 'downloads')
  (data / 'downloads' / '1994-01-100.zip').write_bytes(b'not a zip')
  proc = _run(
    [
      '-m',
      'experiments.prepare',
      '--datasets=shakespeare,cinic10',
      f'--data_dir={data}',
    ]
  )
  assert proc.returncode == 2
  lines = [x for x in proc.stderr.splitlines() if x.strip()]
  assert len(lines) == 1, proc.stderr
  assert lines[0].startswith('error: not prepared: shakespeare: ')
  assert 'not a readable zip archive' in lines[0]
  assert f'  {data / "cinic10"}  (prepared; run with' in proc.stdout
  assert not os.path.exists(data / 'leaf' / 'shakespeare' / 'data')


def test_the_program_offline_leaves_no_tfds_folder_and_names_the_archive(
  tmp_path,
):
  # tfds's default data dir is below $HOME; its download fails as offline.
  home = tmp_path / 'home'
  os.makedirs(home)
  code = (
    'import os, sys\n'
    'import tensorflow_datasets as tfds\n'
    'from tests.data import test_prepare\n'
    'B = test_prepare.FakeBuilder\n'
    "B.default_dir = os.path.expanduser('~/tensorflow_datasets')\n"
    'def offline(self, **kwargs):\n'
    "  os.makedirs(self.data_dir + '.incomplete')\n"
    "  raise ConnectionError('Max retries exceeded with url: ' + self.name)\n"
    'B.download_and_prepare = offline\n'
    'tfds.builder = B\n'
    'from fedjax_mr.data import prepare\n'
    'prepare._has_module = lambda name: True\n'
    'prepare._resolves = lambda host: True\n'
    'from experiments import prepare as program\n'
    "sys.argv = ['prepare', '--datasets=cifar10,cifar100']\n"
    'program.entry()\n'
  )
  proc = subprocess.run(
    [sys.executable, '-c', code],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, 'PYTHONPATH': REPO, 'HOME': str(home)},
  )
  assert proc.returncode == 2
  # One error line, each dataset's reason once, with where its archive goes.
  (line,) = proc.stderr.splitlines()
  assert line.startswith('error: not prepared: cifar10: tensorflow-datasets ')
  for name in ('cifar10', 'cifar100'):
    assert line.count(f'url: {name})') == 1
    assert (
      f'put {name}.tar.gz (from https://example.org/{name}.tar.gz) in '
      'data/downloads by hand'
    ) in line
  assert proc.stdout.count('failed (why: see the error at the end)') == 2
  assert os.listdir(home) == [] and os.listdir(tmp_path) == ['home']


def test_a_run_of_a_missing_tfds_dataset_says_only_its_error(tmp_path):
  home = tmp_path / 'home'
  os.makedirs(home)
  proc = subprocess.run(
    [
      sys.executable,
      '-m',
      'experiments.run',
      '--dataset=cifar10',
      '--model=cnn_cifar',
      f'--workdir={tmp_path / "w"}',
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, 'HOME': str(home), 'TF_CPP_MIN_LOG_LEVEL': '2'},
  )
  assert proc.returncode == 2
  # No tensorflow-datasets warning ('Variant folder ... has no
  # dataset_info.json') before it.
  (line,) = proc.stderr.splitlines()
  assert line.startswith(
    "error: dataset 'cifar10' not found in ~/tensorflow_datasets: prepare it"
  )
  assert os.listdir(home) == []
