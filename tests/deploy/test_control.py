"""The Control API client (`flower/control.py`) against servers that
misbehave: one that never answers, one that refuses every token, and key
files that are not keys. (A real SuperLink's answers, the refused token
included, are tested with the federations: tests/deploy/test_federation.py
and test_deploy_program.py.)"""

from __future__ import annotations

import http.server
import socket
import threading

import pytest

from fedjax_mr.deploy import credentials
from fedjax_mr.deploy import federation
from fedjax_mr.deploy.flower import control


@pytest.fixture
def silent():
  """A port on 127.0.0.1 that accepts connections and never answers."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    s.listen(8)
    yield f'127.0.0.1:{s.getsockname()[1]}'


class _Refuses(http.server.BaseHTTPRequestHandler):
  def do_POST(self):  # noqa: N802 (http.server's name)
    self.rfile.read(int(self.headers.get('content-length', 0)))
    # Seen before the answer goes: the client may read the 401 and the
    # test look at `seen` before this thread runs again.
    self.server.seen.append(self.headers.get('Authorization'))
    self.send_response(401)
    self.send_header('WWW-Authenticate', 'Bearer')
    self.send_header('content-length', '0')
    self.end_headers()

  def log_message(self, *args):
    pass


@pytest.fixture
def refusing():
  """An HTTP server on 127.0.0.1 that answers every request 401; the
  Authorization headers it saw."""
  server = http.server.HTTPServer(('127.0.0.1', 0), _Refuses)
  server.seen = []
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield server
  server.shutdown()
  server.server_close()


def test_a_silent_superlink_is_a_timeout(silent):
  api = control.Control(silent, None, None, timeout=0.5)
  with pytest.raises(control.ControlTimeout, match='ListNodes'):
    api.nodes()
  api.close()


def test_attaching_to_a_silent_superlink_is_one_line(
  silent, tmp_path, monkeypatch
):
  monkeypatch.setattr(federation, 'CHECK_TIMEOUT_S', 0.5)
  fed = federation.Federation.attach(str(tmp_path / 'f'), silent, 1)
  with pytest.raises(federation.FederationError) as e:
    fed.start()
  fed.stop()
  assert str(e.value) == f'the SuperLink at {silent} did not answer in 0.5 s'


def test_a_refused_token_says_so_and_was_sent_as_a_bearer(refusing, tmp_path):
  token = tmp_path / 'token'
  token.write_text('t' * 40 + '\n')
  address = f'127.0.0.1:{refusing.server_address[1]}'
  api = control.Control(address, None, str(token), timeout=5)
  with pytest.raises(control.ControlError) as e:
    api.nodes()
  api.close()
  assert str(e.value) == f'ListNodes: {control.AUTHENTICATION_FAILED}'
  assert refusing.seen == ['Bearer ' + 't' * 40]


def test_a_short_token_file_is_refused_before_any_request(tmp_path):
  token = tmp_path / 'token'
  token.write_text('short')
  with pytest.raises(ValueError, match='not an operator token'):
    control.Control('127.0.0.1:1', None, str(token))


def test_a_key_file_that_is_not_a_key_names_the_file(tmp_path, silent):
  api = control.Control(silent, None, None, timeout=0.5)
  garbage = tmp_path / 'node.pub'
  garbage.write_text('ssh-rsa not a key')
  with pytest.raises(control.ControlError, match=str(garbage)):
    api.register(str(garbage))
  # A real node key is read, and only then is the request made.
  made = credentials.make(str(tmp_path / 'c'), 1)
  with pytest.raises(control.ControlTimeout, match='RegisterNode'):
    api.register(made.node_public_keys[0])
  api.close()
