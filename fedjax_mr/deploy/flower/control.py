"""The SuperLink's Control API from this process: what the federation's
own `flwr supernode register` and `flwr supernode list` did, without a
process each.

A `flwr` command is a fresh Python that imports Flower (about 1 s of CPU)
to make one request; a local federation of N nodes made 2N of them to
start (a registration and an online check per node) and tests poll the
node list. `Control(address, ca, token_file)` makes the same requests
over one connection, as the `flwr` command line makes them: Flower's
protobuf-over-HTTP Control client, the command line's client and
runtime-version headers, and the operator's token as a bearer token
(`superlink.py`: the SuperLink obeys that token alone). The node list is
`flwr supernode list`'s JSON, formatted by Flower's own code.

It leans on names inside Flower (its HTTP client and the list's
formatter), pinned with Flower's version (pyproject.toml); the `flwr`
command line stays what users and the watchdog run.
"""

from __future__ import annotations

import importlib
import json
import threading

import httpx
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.proto import control_pb2
from flwr.supercore import constant as supercore_constant
from flwr.supercore import runtime_version_compatibility as versions
from flwr.supercore.control import ControlHttpClient
from flwr.supercore.error import FlowerError
from flwr.supercore.primitives import asymmetric

from fedjax_mr.deploy.flower import superlink as superlink_lib

# The module of `flwr supernode list` (its package's name `ls` is the
# command's function).
flwr_ls = importlib.import_module('flwr.cli.supernode.ls')

# What the SuperLink says to a request without the operator's token.
AUTHENTICATION_FAILED = 'Authentication failed'


class ControlError(RuntimeError):
  """A Control API request failed; the message is one line."""


class ControlTimeout(ControlError):
  """The SuperLink did not answer in time."""


class _Headers:
  """Flower's HTTP interceptor: the `flwr` command line's headers (its
  client id and runtime version) and the operator's bearer token."""

  def __init__(self, token: str | None):
    meta = versions.RuntimeVersionMetadata.from_local_component('flwr CLI')
    self._headers = dict(meta.as_metadata())
    self._headers[supercore_constant.FLWR_CLIENT_METADATA_KEY] = 'cli'
    if token is not None:
      self._headers['Authorization'] = f'Bearer {token}'

  def intercept(self, context, call_next) -> httpx.Response:
    context.request.headers.update(self._headers)
    return call_next(context)


class Control:
  """The Control API of the SuperLink at `address` (`host:port`).

  Args:
    address: the SuperLink's `host:port`.
    root_certificates: the CA certificate file its TLS certificate is
      signed by; None: without TLS.
    token_file: the file of the operator's token; None: none sent.
    timeout: seconds a request may take.

  Raises:
    ValueError: `token_file` holds no token (`superlink.read_token`).
  """

  def __init__(
    self,
    address: str,
    root_certificates: str | None,
    token_file: str | None,
    timeout: float = 30.0,
  ):
    token = None
    if token_file is not None:
      token = superlink_lib.read_token(token_file)
    insecure = root_certificates is None
    self._client = ControlHttpClient(
      f'{"http" if insecure else "https"}://{address}',
      interceptors=[_Headers(token)],
      verify=False if insecure else root_certificates,
      timeout=timeout,
    )
    self._lock = threading.Lock()  # one request at a time

  def _call(self, method: str, request):
    """`method`'s reply to `request`; raises ControlError (one line)."""
    try:
      with self._lock:
        return getattr(self._client, method)(request)
    except httpx.TimeoutException:
      raise ControlTimeout(f'{method}: no answer in time') from None
    except httpx.HTTPStatusError as e:
      response = e.response
      error = FlowerError.from_json(response.text)
      if error is not None:
        said = ' '.join(
          s for s in (f'[code: {error.code}]', error.message) if s
        )
      elif response.status_code == httpx.codes.UNAUTHORIZED:
        said = AUTHENTICATION_FAILED
      else:
        said = f'HTTP {response.status_code}'
      raise ControlError(f'{method}: {said}') from None
    except (httpx.HTTPError, ValueError) as e:
      raise ControlError(f'{method}: {e}') from None

  def register(self, public_key_file: str) -> int:
    """Registers the SuperNode whose public key (OpenSSH format, on a NIST
    curve, as `flwr supernode register` reads it) is in `public_key_file`;
    the node id given."""
    try:
      with open(public_key_file, 'rb') as f:
        key = serialization.load_ssh_public_key(f.read())
    except (OSError, ValueError, UnsupportedAlgorithm) as e:
      raise ControlError(f'public key {public_key_file}: {e}') from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or (
      not asymmetric.uses_nist_ec_curve(key)
    ):
      raise ControlError(f'public key {public_key_file}: not on a NIST curve')
    reply = self._call(
      'RegisterNode',
      control_pb2.RegisterNodeRequest(
        public_key=asymmetric.public_key_to_bytes(key)
      ),
    )
    if not reply.node_id:
      raise ControlError('RegisterNode: no node id given')
    return int(reply.node_id)

  def nodes(self) -> list[dict[str, str]]:
    """The SuperNodes, as `flwr supernode list` lists them in JSON:
    per node its `node-id`, `status`, `online-at`, `offline-at`, …"""
    reply = self._call('ListNodes', control_pb2.ListNodesRequest())
    rows = flwr_ls._format_nodes(list(reply.nodes_info), reply.now)
    return json.loads(flwr_ls._to_json(rows, verbose=False))['nodes']

  def close(self) -> None:
    self._client.close()
