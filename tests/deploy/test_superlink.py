"""The operator's token (fedjax_mr/deploy/flower/superlink.py): what the
SuperLink's Control API accepts, and what the `flwr` command line sends.
A real SuperLink refusing everyone else: test_federation.py."""

import os
import subprocess
import sys

import pytest
from flwr.cli import utils as cli_utils
from flwr.common import constant as flwr_constant
from flwr.supercore import error as flwr_error

from fedjax_mr.core import errors
from fedjax_mr.deploy import credentials
from fedjax_mr.deploy import launch
from fedjax_mr.deploy.flower import superlink

TOKEN = 'a' * 20 + 'B' * 23
ACCESS = flwr_constant.ACCESS_TOKEN_KEY


def test_only_the_token_passes():
  plugin = superlink.OperatorAuthn(TOKEN)
  ok, account = plugin.validate_tokens_in_metadata([(ACCESS, TOKEN)])
  assert ok and account.flwr_aid == flwr_constant.NOOP_FLWR_AID
  assert plugin.validate_tokens_in_metadata([(ACCESS, TOKEN.encode())])[0]
  for metadata in (
    [],
    [(ACCESS, TOKEN[:-1])],
    [(ACCESS, TOKEN + 'x')],
    [(ACCESS, '')],
    [(flwr_constant.REFRESH_TOKEN_KEY, TOKEN)],
  ):
    assert plugin.validate_tokens_in_metadata(metadata) == (False, None)
  # Nothing issues or refreshes a token.
  assert plugin.get_login_details() is None
  assert plugin.refresh_tokens([(ACCESS, TOKEN)]) == (None, None)
  with pytest.raises(flwr_error.FlowerError):
    plugin.get_auth_tokens('code')
  with pytest.raises(ValueError, match='token'):
    superlink.OperatorAuthn('')


def test_a_token_file_is_one_line_of_enough_printable_characters(tmp_path):
  path = str(tmp_path / 'token')
  with open(path, 'w') as f:
    f.write(f'  {TOKEN}\n')
  assert superlink.read_token(path) == TOKEN
  for content, says in (
    (b'short', 'at least 32'),
    (TOKEN[:16].encode() + b'\n' + TOKEN[16:].encode(), 'one line'),
    (b'\xff' * 40, 'not ASCII'),
  ):
    with open(path, 'wb') as f:
      f.write(content)
    with pytest.raises(ValueError, match=says):
      superlink.read_token(path)
  with pytest.raises(ValueError, match='No such file'):
    superlink.read_token(str(tmp_path / 'none'))
  # A fresh secret is a token (make_secrets' operator token).
  made = credentials.make_secrets(str(tmp_path / 'secrets'))
  assert len(superlink.read_token(made.operator_token)) == 64
  assert os.stat(made.operator_token).st_mode & 0o777 == 0o600
  assert os.stat(tmp_path / 'secrets').st_mode & 0o777 == 0o700


def test_the_operators_home_makes_flwr_send_the_token(tmp_path, monkeypatch):
  token_file = tmp_path / 'token'
  token_file.write_text(TOKEN)
  home = str(tmp_path / 'ops')
  address = '127.0.0.1:9092'
  superlink.operator_home(home, address, None, str(token_file), 'fleet')
  assert os.stat(home).st_mode & 0o777 == 0o700
  assert os.stat(f'{home}/credentials.yaml').st_mode & 0o777 == 0o600
  with open(f'{home}/config.toml') as f:
    assert f'address = "{address}"' in f.read()
  # Flower's own command line, in that home, loads the token and writes
  # it into each Control API request's metadata.
  monkeypatch.setenv('FLWR_HOME', home)
  from flwr.supercore.credential_store import file_credential_store

  monkeypatch.setattr(
    file_credential_store,
    'CREDENTIAL_FILE_PATH',
    file_credential_store.Path(home) / 'credentials.yaml',
  )
  plugin = cli_utils.load_cli_auth_plugin_from_connection(address)
  plugin.load_tokens()
  assert (ACCESS, TOKEN) in plugin.write_tokens_to_metadata([])
  with pytest.raises(ValueError, match='at least'):
    token_file.write_text('short')
    superlink.operator_home(home, address, None, str(token_file))


def test_the_program_says_one_line_before_flower_starts(tmp_path):
  short = tmp_path / 'short'
  short.write_text('x')
  for args in (
    [],
    ['--superlink-arguments-only'],
    [superlink.OPTION, str(short), '--port', '1'],
  ):
    done = subprocess.run(
      [sys.executable, '-m', 'fedjax_mr.deploy.flower.superlink', *args],
      capture_output=True,
      text=True,
      timeout=120,
    )
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_the_plugin_is_what_the_superlinks_command_line_loads():
  saved = superlink.superlink_cli.load_control_authn_plugin
  try:
    superlink.install(TOKEN)
    plugin = superlink.superlink_cli.load_control_authn_plugin()
    assert isinstance(plugin, superlink.OperatorAuthn)
    assert plugin.validate_tokens_in_metadata([(ACCESS, TOKEN)])[0]
  finally:
    superlink.superlink_cli.load_control_authn_plugin = saved


def test_a_superlink_started_here_listens_on_loopback_unless_exposed():
  for host in ('127.0.0.1', '127.0.0.2', '::1', 'localhost'):
    launch._check_host(host, False, None)
  for host in ('0.0.0.0', '10.1.2.3', '::', 'example.org'):
    with pytest.raises(errors.ConfigError, match='expose_federation'):
      launch._check_host(host, False, None)
    launch._check_host(host, True, None)
  # A running federation's host is its own.
  launch._check_host('0.0.0.0', False, object())
