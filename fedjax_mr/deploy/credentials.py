"""The certificates, node keys and secrets a federation needs, made
locally.

`make(folder, num_nodes, hosts)` writes a certificate authority, the
SuperLink's TLS certificate (signed by it, valid for `hosts`) and one
authentication key pair per SuperNode (EC P-384, OpenSSH format, which
Flower reads; each node also signs its clients' secure-aggregation keys
with it) and the roster of the nodes' public keys (`write_roster`), with
`cryptography`, the package flwr depends on.
`make_secrets(folder)` writes the operator's token (the only credential
the SuperLink's Control API accepts: `flower/superlink.py`) and the SuperExecs'
shared secret (Flower's `superexec-auth-secret-file` option: a SuperExec
without it gets no task). The folder is its owner's alone (0700) and
private keys and secrets are readable by their owner only (0600).
Nothing is sent anywhere: the CA certificate goes to every node, each
node's private key to that node alone, the public keys are registered
with the SuperLink, and the secrets stay with the processes started here.
`check_server` checks a server's certificate against a CA's.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import secrets
import socket
import ssl
from typing import NamedTuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

# Certificates are valid this long: a federation's run, with room.
VALID_DAYS = 30


class Credentials(NamedTuple):
  """Paths of what `make` wrote.

  Attributes:
    ca_cert: the CA certificate (PEM), which every node trusts.
    server_cert: the SuperLink's certificate (PEM).
    server_key: its private key (PEM).
    node_keys: `[num_nodes]` private authentication keys (OpenSSH).
    node_public_keys: the matching public keys (OpenSSH), to register.
    roster: every node's public key by index (`write_roster`), which
      every node gets to check the others' signatures.
  """

  ca_cert: str
  server_cert: str
  server_key: str
  node_keys: tuple[str, ...]
  node_public_keys: tuple[str, ...]
  roster: str = ''


class Secrets(NamedTuple):
  """Paths of what `make_secrets` wrote.

  Attributes:
    operator_token: the Control API's operator token (text).
    superexec_secret: the SuperExecs' shared secret (raw bytes).
  """

  operator_token: str
  superexec_secret: str


def private_folder(folder: str) -> str:
  """`folder`, created if missing and made its owner's alone (0700)."""
  os.makedirs(folder, mode=0o700, exist_ok=True)
  os.chmod(folder, 0o700)
  return folder


def _write(path: str, data: bytes, private: bool = False) -> None:
  flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
  fd = os.open(path, flags, 0o600 if private else 0o644)
  with os.fdopen(fd, 'wb') as f:
    f.write(data)
  # A file that existed keeps its mode through O_CREAT: set it.
  os.chmod(path, 0o600 if private else 0o644)


def write_secret(path: str) -> str:
  """Writes a fresh secret (256 random bits from the OS's generator, as
  64 hexadecimal digits) to `path`, readable by its owner only; `path`."""
  _write(path, secrets.token_hex(32).encode(), private=True)
  return path


def make_secrets(folder: str) -> Secrets:
  """Writes a fresh operator token and SuperExec secret (`write_secret`)
  into `folder` (created, 0700)."""
  private_folder(folder)
  return Secrets(
    write_secret(os.path.join(folder, 'operator.token')),
    write_secret(os.path.join(folder, 'superexec.secret')),
  )


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
  return key.private_bytes(
    serialization.Encoding.PEM,
    serialization.PrivateFormat.PKCS8,
    serialization.NoEncryption(),
  )


def _name(common_name: str) -> x509.Name:
  return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: tuple[str, ...]) -> x509.SubjectAlternativeName:
  names: list[x509.GeneralName] = []
  for host in hosts:
    try:
      names.append(x509.IPAddress(ipaddress.ip_address(host)))
    except ValueError:
      names.append(x509.DNSName(host))
  return x509.SubjectAlternativeName(names)


def _certificate(
  subject: x509.Name,
  key: ec.EllipticCurvePrivateKey,
  issuer: x509.Name,
  issuer_key: ec.EllipticCurvePrivateKey,
  ca: bool,
  hosts: tuple[str, ...] = (),
) -> x509.Certificate:
  now = datetime.datetime.now(datetime.timezone.utc)
  builder = (
    x509.CertificateBuilder()
    .subject_name(subject)
    .issuer_name(issuer)
    .public_key(key.public_key())
    .serial_number(x509.random_serial_number())
    .not_valid_before(now - datetime.timedelta(minutes=5))
    .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    .add_extension(x509.BasicConstraints(ca=ca, path_length=None), True)
  )
  if hosts:
    builder = builder.add_extension(_san(hosts), False)
  return builder.sign(issuer_key, hashes.SHA256())


def make(
  folder: str, num_nodes: int, hosts: tuple[str, ...] = ('127.0.0.1',)
) -> Credentials:
  """Writes a CA, the SuperLink's certificate for `hosts` and
  `num_nodes` node key pairs into `folder` (created).

  Args:
    folder: where the files go.
    num_nodes: node key pairs to make (>= 1).
    hosts: the names and IP addresses the SuperLink is reached at; the
      loopback names are always added (its own processes use them).

  Raises:
    ValueError: `num_nodes` < 1 or `hosts` empty.
  """
  if num_nodes < 1:
    raise ValueError(f'num_nodes must be >= 1, got {num_nodes}')
  hosts = tuple(dict.fromkeys((*hosts, '127.0.0.1', 'localhost')))
  private_folder(folder)
  ca_key = ec.generate_private_key(ec.SECP384R1())
  ca_name = _name('fedjax_mr federation CA')
  ca = _certificate(ca_name, ca_key, ca_name, ca_key, ca=True)
  server_key = ec.generate_private_key(ec.SECP384R1())
  server = _certificate(
    _name('fedjax_mr superlink'), server_key, ca_name, ca_key, False, hosts
  )
  pem = serialization.Encoding.PEM
  paths = {
    n: os.path.join(folder, n) for n in ('ca.crt', 'server.crt', 'server.key')
  }
  _write(paths['ca.crt'], ca.public_bytes(pem))
  _write(paths['server.crt'], server.public_bytes(pem))
  _write(paths['server.key'], _pem_key(server_key), private=True)
  keys, public = [], []
  for i in range(num_nodes):
    keys.append(os.path.join(folder, f'node{i}.key'))
    public.append(keys[-1] + '.pub')
    write_node_key(keys[-1], public[-1])
  roster = write_roster(os.path.join(folder, 'roster.json'), tuple(public))
  return Credentials(
    paths['ca.crt'],
    paths['server.crt'],
    paths['server.key'],
    tuple(keys),
    tuple(public),
    roster,
  )


def write_roster(path: str, public_keys: tuple[str, ...]) -> str:
  """Writes `{index: OpenSSH public key}` of the nodes whose public key
  files are `public_keys` (node i the i-th) to `path`: what each node
  checks the others' signatures against (secure aggregation's keys,
  `deploy.secure_node`); `path`."""
  listed = {}
  for i, public in enumerate(public_keys):
    with open(public) as f:
      listed[str(i)] = f.read().strip()
  _write(path, json.dumps(listed, indent=1).encode())
  return path


def write_node_key(private_path: str, public_path: str) -> None:
  """Writes one node's authentication key pair (EC P-384, OpenSSH)."""
  key = ec.generate_private_key(ec.SECP384R1())
  _write(
    private_path,
    key.private_bytes(
      serialization.Encoding.PEM,
      serialization.PrivateFormat.OpenSSH,
      serialization.NoEncryption(),
    ),
    private=True,
  )
  _write(
    public_path,
    key.public_key().public_bytes(
      serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ),
  )


def check_server(sock: socket.socket, host: str, ca: str) -> None:
  """A TLS handshake on `sock` with the server `host`, trusting only the
  CA certificate file `ca`.

  Raises:
    ValueError: `ca` is not a certificate file, or the server's
      certificate is not the CA's for `host` (the message says which).
  """
  try:
    context = ssl.create_default_context(cafile=ca)
  except (ssl.SSLError, ValueError, UnicodeDecodeError):
    raise ValueError(f'{ca} is not a PEM CA certificate file') from None
  except OSError as e:
    raise ValueError(f'{ca}: {e.strerror or e}') from None
  try:
    context.wrap_socket(sock, server_hostname=host).close()
  except ssl.SSLCertVerificationError as e:
    raise ValueError(
      f"the SuperLink's certificate at {host} is not one the CA in {ca} "
      f'signed for that address ({e.verify_message})'
    ) from None
