"""`fedjax_mr.data.download`, against a local HTTP server: whole or
nothing, resumed, checked, and the next URL tried."""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import threading
import types

import pytest

from fedjax_mr.core import errors
from fedjax_mr.data import download


@pytest.fixture
def server():
  """A local HTTP server of one payload; `mode` changes how it answers."""

  class Handler(http.server.BaseHTTPRequestHandler):
    payload = bytes(range(256)) * 40_000  # 10.24 MB: several chunks
    mode = 'ok'  # 'ok', 'no_range', 'truncate', 'missing'
    ranges: list = []

    def do_GET(self):  # noqa: N802 - the http.server API
      cls = type(self)
      if cls.mode == 'missing':
        self.send_error(404)
        return
      asked = self.headers.get('Range')
      cls.ranges.append(asked)
      body = cls.payload
      if asked and cls.mode != 'no_range':
        start = int(asked.split('=')[1].rstrip('-'))
        if start >= len(body):
          self.send_response(416)
          self.end_headers()
          return
        self.send_response(206)
        body = body[start:]
      else:
        self.send_response(200)
      self.send_header('Content-Length', str(len(body)))
      self.end_headers()
      if cls.mode == 'truncate':
        self.wfile.write(body[: len(body) // 3])
        self.close_connection = True
        return
      self.wfile.write(body)

    def log_message(self, *args):
      del args

  httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  url = f'http://127.0.0.1:{httpd.server_address[1]}/file.bin'
  yield types.SimpleNamespace(url=url, handler=Handler)
  httpd.shutdown()
  httpd.server_close()


def test_download_is_checked_and_renamed(tmp_path, server):
  path = str(tmp_path / 'dl' / 'file.bin')
  md5 = hashlib.md5(server.handler.payload).hexdigest()
  out = io.StringIO()
  download.download(server.url, path, md5=md5, progress=out)
  with open(path, 'rb') as f:
    assert f.read() == server.handler.payload
  assert os.listdir(tmp_path / 'dl') == ['file.bin']
  assert out.getvalue().endswith('\rfile.bin: 100% of 10.2 MB\n')


def test_download_resumes_a_part_file(tmp_path, server):
  path = str(tmp_path / 'file.bin')
  with open(path + '.part', 'wb') as f:
    f.write(server.handler.payload[:1000])
  download.download(server.url, path, progress=io.StringIO())
  assert server.handler.ranges == ['bytes=1000-']
  with open(path, 'rb') as f:
    assert f.read() == server.handler.payload
  # A server that ignores the range sends it all: started again.
  server.handler.mode = 'no_range'
  with open(path + '.part', 'wb') as f:
    f.write(b'stale bytes')
  os.remove(path)
  download.download(server.url, path, progress=io.StringIO())
  with open(path, 'rb') as f:
    assert f.read() == server.handler.payload


def test_an_interrupted_download_leaves_only_its_part_file(tmp_path, server):
  path = str(tmp_path / 'file.bin')
  server.handler.mode = 'truncate'
  with pytest.raises(errors.DataError, match='run again to resume'):
    download.download(server.url, path, progress=io.StringIO())
  assert os.listdir(tmp_path) == ['file.bin.part']
  third = len(server.handler.payload) // 3
  assert os.path.getsize(path + '.part') == third
  server.handler.mode = 'ok'
  sha = hashlib.sha256(server.handler.payload).hexdigest()
  download.download(server.url, path, sha256=sha, progress=io.StringIO())
  assert server.handler.ranges[-1] == f'bytes={third}-'
  assert os.listdir(tmp_path) == ['file.bin']


def test_a_checksum_mismatch_keeps_nothing(tmp_path, server):
  path = str(tmp_path / 'file.bin')
  with pytest.raises(errors.DataError, match='is not the published 00'):
    download.download(server.url, path, md5='00' * 16, progress=io.StringIO())
  assert os.listdir(tmp_path) == []


def test_unreachable_and_missing_urls(tmp_path, server):
  path = str(tmp_path / 'file.bin')
  with pytest.raises(errors.DataError, match='cannot download'):
    download.download('http://127.0.0.1:9/x', path, progress=io.StringIO())
  server.handler.mode = 'missing'
  with pytest.raises(errors.DataError, match='HTTP error 404'):
    download.download(server.url, path, progress=io.StringIO())
  assert os.listdir(tmp_path) == []


def test_the_next_url_is_tried(tmp_path, server):
  source = download.Source(('http://127.0.0.1:9/x', server.url), 'file.bin')
  lines = []
  path = download.fetch(source, str(tmp_path), download.download, lines.append)
  assert path == str(tmp_path / 'file.bin') and os.path.isfile(path)
  assert lines == [f'  downloading {u}' for u in source.urls]


def test_sizes_in_words():
  assert download.human_size(512) == '512 B'
  assert download.human_size(3_400_000) == '3.4 MB'
  assert download.human_size(1_234_000_000) == '1.2 GB'
  assert download.human_size(5 * 10**12) == '5000.0 GB'
