"""Fetching the datasets' archives: whole, resumable, checked.

Every download goes through `download`: all or nothing (the bytes go to a
`.part` file, renamed when complete), resumed by the next run after an
interruption, and checked against a checksum where the source publishes
one (none of our four sources does; tensorflow-datasets checks its own).

`fetch` gets one `Source` into a folder (`DOWNLOADS` below the data root,
see `prepare`): an archive already there is used as it is, so a machine
without internet access can be given the archives by hand; otherwise the
source's URLs are tried in order. `open_zip` reads a downloaded zip and
says to download it anew when it is damaged.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import sys
import time
import urllib.error
import urllib.request
import zipfile
import zlib
from typing import Callable
from typing import Iterator
from typing import NamedTuple
from typing import TextIO

from fedjax_mr.core import errors

# The folder below the data root where archives are downloaded to, and
# where an archive put by hand is found.
DOWNLOADS = 'downloads'


class Source(NamedTuple):
  """A file to download: its URLs (tried in order), the name it is saved
  under and the checksums its publisher gives (None: none published)."""

  urls: tuple[str, ...]
  filename: str
  md5: str | None = None
  sha256: str | None = None


# `download`'s signature, (url, path, *, md5, sha256) -> None; tests give
# `prepare` one that copies their fixtures.
Fetch = Callable[..., None]

_TIMEOUT_S = 60  # seconds without a byte before a download gives up
_CHUNK = 1 << 20


def download(
  url: str,
  path: str,
  *,
  md5: str | None = None,
  sha256: str | None = None,
  progress: TextIO | None = None,
) -> None:
  """Downloads `url` to `path`, all or nothing, resuming an earlier try.

  The bytes go to `path + '.part'`, which is renamed to `path` once whole
  and matching the checksums given. A `.part` left by an interrupted
  download is continued with an HTTP range request (started again when the
  server ignores it). A progress line goes to `progress` (stderr).

  Raises:
    DataError: the server cannot be reached or refuses; the download
      stopped early (the `.part` file stays, for the next try to resume);
      a checksum does not match (the `.part` file is deleted).
  """
  out = progress or sys.stderr
  part = path + '.part'
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  have = os.path.getsize(part) if os.path.exists(part) else 0
  response = _open(url, have)
  if response is not None:
    _receive(response, url, path, have, out)
  _check_digests(url, part, md5=md5, sha256=sha256)
  os.replace(part, path)


def _open(url: str, have: int):
  """The HTTP response to a GET of `url` from byte `have` on, or None when
  the server says the `.part` file of `have` bytes is already whole."""
  headers = {'User-Agent': 'fedjax_mr-prepare'}
  if have:
    headers['Range'] = f'bytes={have}-'
  request = urllib.request.Request(url, headers=headers)
  try:
    return urllib.request.urlopen(request, timeout=_TIMEOUT_S)
  except urllib.error.HTTPError as e:
    if not (e.code == 416 and have):  # 416: the .part file is already whole
      raise errors.DataError(f'{url}: HTTP error {e.code} {e.reason}') from None
  except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
    raise errors.DataError(f'{url}: cannot download ({_reason(e)})') from None
  return None


def _receive(response, url: str, path: str, have: int, out: TextIO) -> None:
  """Appends `response`'s bytes to `path + '.part'` (which holds `have`
  bytes; started again when the server sends the whole file), showing
  progress on `out`.

  Raises:
    DataError: the download stopped before the announced length.
  """
  part = path + '.part'
  with response:
    if have and getattr(response, 'status', None) != 206:
      have = 0  # the server sends the whole file
    length = response.headers.get('Content-Length', '')
    total = have + int(length) if length.isdigit() else None
    done = have
    shown = -1.0
    with open(part, 'ab' if have else 'wb') as f:
      while True:
        try:
          chunk = response.read(_CHUNK)
        except (OSError, http.client.HTTPException) as e:
          chunk, error = b'', e
        else:
          error = None
        if not chunk:
          break
        f.write(chunk)
        done += len(chunk)
        now = time.monotonic()
        if now - shown >= 0.5:
          shown = now
          _show_progress(out, os.path.basename(path), done, total)
    _show_progress(out, os.path.basename(path), done, total, end='\n')
  if error is not None or (total is not None and done < total):
    reason = f' ({_reason(error)})' if error is not None else ''
    raise errors.DataError(
      f'{url}: the download stopped after {human_size(done)}{reason}; run '
      f'again to resume it ({part})'
    )


def _check_digests(
  url: str, part: str, *, md5: str | None, sha256: str | None
) -> None:
  """Raises DataError (and deletes `part`) when a checksum given does not
  match the downloaded bytes."""
  for algorithm, want in (('md5', md5), ('sha256', sha256)):
    if want:
      got = _file_digest(part, algorithm)
      if got != want.lower():
        os.remove(part)
        raise errors.DataError(
          f'{url}: {algorithm} {got} is not the published {want}; the '
          'download was deleted, run again to download it anew'
        )


def _show_progress(
  out: TextIO, name: str, done: int, total: int | None, end: str = ''
) -> None:
  if total:
    text = f'{name}: {100 * done / total:3.0f}% of {human_size(total)}'
  else:
    text = f'{name}: {human_size(done)}'
  out.write(f'\r{text}{end}')
  out.flush()


def _reason(error: BaseException) -> str:
  reason = getattr(error, 'reason', None) or error
  return str(reason) or type(error).__name__


def _file_digest(path: str, algorithm: str) -> str:
  digest = hashlib.new(algorithm)
  with open(path, 'rb') as f:
    for chunk in iter(lambda: f.read(_CHUNK), b''):
      digest.update(chunk)
  return digest.hexdigest()


def human_size(size: int) -> str:
  """`size` bytes in words: '512 B', '3.4 MB', '1.2 GB' (powers of 1000)."""
  value = float(size)
  for unit in ('B', 'KB', 'MB', 'GB'):
    if value < 1000 or unit == 'GB':
      return f'{size} B' if unit == 'B' else f'{value:.1f} {unit}'
    value /= 1000
  raise AssertionError('unreachable')


def fetch(
  source: Source, folder: str, fetch_url: Fetch, log: Callable[[str], None]
) -> str:
  """`source` downloaded into `folder` (kept from an earlier run, or put
  there by hand, if there), trying its URLs in order with `fetch_url`
  (`download`).

  Returns:
    The path of the archive.

  Raises:
    DataError: every URL failed; the message says where to put the
      archive by hand.
  """
  path = os.path.join(folder, source.filename)
  if os.path.isfile(path):
    log(f'  using {path} (downloaded before)')
    return path
  problems = []
  for url in source.urls:
    log(f'  downloading {url}')
    try:
      fetch_url(url, path, md5=source.md5, sha256=source.sha256)
    except errors.DataError as e:
      problems.append(str(e))
      continue
    return path
  raise errors.DataError(
    f'{"; ".join(problems)} (or put {source.filename} in {folder} by hand)'
  )


@contextlib.contextmanager
def open_zip(path: str) -> Iterator[zipfile.ZipFile]:
  """A downloaded zip archive, open for reading; an unreadable or damaged
  one is a DataError that says to download it anew."""
  try:
    z = zipfile.ZipFile(path)
  except (zipfile.BadZipFile, OSError) as e:
    raise errors.DataError(
      f'{path}: not a readable zip archive ({e}); delete it to download it anew'
    ) from None
  with z:
    try:
      yield z
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:
      raise errors.DataError(
        f'{path}: damaged zip archive ({e}); delete it to download it anew'
      ) from None
