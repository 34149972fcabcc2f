"""Flower's `flower-superlink`, whose Control API obeys its operator only.

The Control API (on the SuperLink's one port, beside the Fleet API) is
where runs are submitted, listed, logged and stopped, and where node keys
are registered and removed. Flower 1.42 authenticates its callers only
through an account-authentication plugin, and its open-source build has
none but one that lets everybody in: anyone who reaches the port with the
public CA certificate could run code on the server and every node.

`python -m fedjax_mr.deploy.flower.superlink`, its first option
`operator-token-file PATH` (two dashes, as Flower's own options) and then
the arguments of `flower-superlink`, is `flower-superlink` with Flower's
plugin interface filled by `OperatorAuthn`: a Control API request passes
only with `Authorization: Bearer <the file's token>`, which Flower's
`flwr` command line sends from its credential store
(`store_operator_token` writes the entry; `federation.Federation` does for
its runs). The token is compared as a SHA-256 digest in constant time;
logging in or refreshing a token is refused (the token is the operator's
only credential, handed over as a file).

`operator_home` writes the operator's own Flower home (the connection's
config and the token): `FLWR_HOME=<it> flwr ...` is then obeyed. It leans
on one name inside Flower (the plugin loader the SuperLink's
command line calls), pinned with Flower's version (pyproject.toml).
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import json
import os
import pathlib
import sys
from typing import Sequence

from flwr.cli import constant as cli_constant
from flwr.common import constant as flwr_constant
from flwr.supercore import error as flwr_error
from flwr.supercore.auth import typing as auth_typing
from flwr.supercore.credential_store import file_credential_store
from flwr.superlink import auth_plugin

# The module (its package's name `flower_superlink` is the function).
superlink_cli = importlib.import_module('flwr.superlink.cli.flower_superlink')

OPTION = '-' * 2 + 'operator-token-file'  # Flower's spelling
# Shortest token file accepted (bytes of text), so a typo or an empty
# file is not a password.
MIN_TOKEN_CHARS = 32


def read_token(path: str) -> str:
  """The operator token in file `path` (surrounding whitespace dropped).

  Raises:
    ValueError: the file cannot be read, is not text or is shorter than
      MIN_TOKEN_CHARS (the message says which, not the path).
  """
  try:
    token = pathlib.Path(path).read_bytes().decode('ascii').strip()
  except OSError as e:
    raise ValueError(e.strerror or str(e)) from None
  except UnicodeDecodeError:
    raise ValueError('not an operator token (not ASCII)') from None
  if len(token) < MIN_TOKEN_CHARS or not token.isprintable():
    raise ValueError(
      f'not an operator token (at least {MIN_TOKEN_CHARS} printable '
      'characters on one line)'
    )
  return token


def _digest(token: str) -> bytes:
  return hashlib.sha256(token.encode()).digest()


class OperatorAuthn(auth_plugin.ControlAuthnPlugin):
  """Flower's Control API authentication: the operator's token or nothing.

  Args:
    token: the operator's token.
  """

  def __init__(self, token: str = ''):
    if not token:
      raise ValueError('token must not be empty')
    self._digest = _digest(token)

  def _account(self) -> auth_typing.AccountInfo:
    # Flower's single-account identity, as without authentication: the
    # operator owns the runs and the default federation as before.
    return auth_typing.AccountInfo(
      flwr_aid=flwr_constant.NOOP_FLWR_AID,
      account_name=flwr_constant.NOOP_ACCOUNT_NAME,
    )

  def validate_tokens_in_metadata(
    self, metadata: Sequence[tuple[str, str | bytes]]
  ) -> tuple[bool, auth_typing.AccountInfo | None]:
    """(True, the operator) for the operator's token; (False, None)
    otherwise."""
    for key, value in metadata:
      if key != flwr_constant.ACCESS_TOKEN_KEY:
        continue
      text = value.decode() if isinstance(value, bytes) else str(value)
      if hmac.compare_digest(_digest(text), self._digest):
        return True, self._account()
    return False, None

  def get_login_details(self) -> None:
    """None: there is no log-in; the token is handed over as a file."""
    return None

  def get_auth_tokens(self, device_code: str) -> None:
    """Refused: tokens are never issued."""
    raise flwr_error.FlowerError(
      flwr_error.ApiErrorCode.ACCOUNT_AUTHENTICATION_FAILED,
      'this SuperLink issues no tokens: use the operator token file',
    )

  def refresh_tokens(
    self, metadata: Sequence[tuple[str, str | bytes]]
  ) -> tuple[None, None]:
    """(None, None): tokens are never refreshed (Flower then refuses)."""
    return None, None


def store_operator_token(home: str, address: str, token: str) -> None:
  """Writes `token` as the `flwr` command line's credential for the
  SuperLink at `address`, in Flower's credential store of Flower home
  `home` (`credentials.yaml`, readable by its owner only), so that `flwr`
  run with `FLWR_HOME=home` sends it."""
  path = pathlib.Path(home) / 'credentials.yaml'
  store = file_credential_store.FileCredentialStore(path)
  # Flower's OIDC command-line plugin sends a stored access token as a
  # bearer token; the refresh token is never used (refreshing is refused).
  store.set(
    cli_constant.AUTHN_TYPE_STORE_KEY % address,
    flwr_constant.AuthnType.OIDC.encode(),
  )
  store.set(cli_constant.ACCESS_TOKEN_STORE_KEY % address, token.encode())
  store.set(cli_constant.REFRESH_TOKEN_STORE_KEY % address, b'unused')
  path.chmod(0o600)


def operator_home(
  home: str,
  address: str,
  root_certificates: str | None,
  token_file: str | None,
  name: str = 'fleet',
) -> str:
  """Makes `home` (created, 0700) a Flower home whose `flwr` commands
  reach the SuperLink at `address` as connection `name` (its default),
  trusting the CA certificate file `root_certificates` (None: without
  TLS), with the operator's token of `token_file` (None: none); `home`.

  Raises:
    ValueError: `token_file` holds no token (`read_token`).
  """
  token = None if token_file is None else read_token(token_file)
  os.makedirs(home, mode=0o700, exist_ok=True)
  os.chmod(home, 0o700)
  lines = [
    '[superlink]',
    f'default = "{name}"',
    f'[superlink.{name}]',
    f'address = "{address}"',
  ]
  if root_certificates is None:
    lines.append('insecure = true')
  else:
    ca = json.dumps(os.path.abspath(root_certificates))  # a TOML string
    lines.append(f'root-certificates = {ca}')
  with open(os.path.join(home, 'config.toml'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  if token is not None:
    store_operator_token(home, address, token)
  return home


def install(token: str) -> None:
  """Makes this process's SuperLink authenticate Control API callers by
  `token`."""
  plugin = OperatorAuthn(token)
  superlink_cli.load_control_authn_plugin = lambda: plugin


def main() -> None:
  args = sys.argv[1:]
  if len(args) < 2 or args[0] != OPTION:
    sys.exit(f'usage: {sys.argv[0]} {OPTION} PATH <flower-superlink arguments>')
  try:
    install(read_token(args[1]))
  except ValueError as e:
    sys.exit(f'{OPTION} {args[1]}: {e}')
  sys.argv = ['flower-superlink', *args[2:]]
  superlink_cli.flower_superlink()


if __name__ == '__main__':
  main()
