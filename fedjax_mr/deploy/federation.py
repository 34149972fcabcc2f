"""A Flower federation on this machine: a SuperLink and N SuperNodes.

`Federation(folder, num_nodes, ...)` starts, as processes, a SuperLink on
`host` (127.0.0.1 unless given) and N SuperNodes that connect to it, each
on free ports; `run(app_dir, run_config)` submits a Flower App to it
(`flwr run`) and waits for the run to end; `stop()` (or leaving the
`with` block) stops every process it started.

Secure by default: TLS with a CA and certificates made in
`<folder>/credentials` (`credentials.make`), and Flower's node
authentication: each SuperNode holds its own key, whose public half is
registered with the SuperLink before the node starts (its registration
gives the node's id, `node_ids`); a node with another key is refused.
`insecure=True` runs without either (the caller warns).

`Federation.attach(folder, address, num_nodes, ...)` is a SuperLink
running elsewhere (a real fleet's): `start()` then starts nothing of the
federation, only what submits runs to it, and `stop()` stops only that.

Everything Flower writes stays in `folder`: its home (`FLWR_HOME`), the
processes' logs, temporary files. Telemetry is off, runtime dependency
installation (`uv sync`) is off (the environment is this one, and it may
be offline), and the processes start from this Python's environment (its
`bin` first on PATH, where `flower-superexec` is).

Every process joins one process group, led by a watchdog
(`fedjax_mr/core/watchdog.py`) that stops the group when the program
that started it ends in any way, SIGKILL included.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent import futures
from typing import Callable
from typing import Mapping
from typing import NamedTuple
from typing import Sequence

from fedjax_mr.core import watchdog
from fedjax_mr.deploy import credentials as credentials_lib

# The warm SuperExec's module (`warm.py`; not imported here: it imports
# Flower and JAX).
WARM_SUPEREXEC = 'fedjax_mr.deploy.warm'
# `flower-supernode` beating at an interval of its own (`supernode.py`).
SUPERNODE = 'fedjax_mr.deploy.supernode'
# The heartbeat intervals a SuperLink accepts, in s (Flower's
# HEARTBEAT_MIN_INTERVAL and HEARTBEAT_MAX_INTERVAL; supernode.py reads
# them from Flower).
HEARTBEAT_S = (10.0, 1800.0)

FEDERATION = 'local'  # the connection's name in Flower's config.toml
START_TIMEOUT_S = 120.0


class FederationError(RuntimeError):
  """A federation process failed to start or a run failed; the message
  names the log to read."""


def free_port(host: str = '127.0.0.1') -> int:
  """A TCP port free on `host` now (the OS's choice)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def _toml_value(value) -> str:
  if isinstance(value, bool):
    return 'true' if value else 'false'
  if isinstance(value, (int, float)):
    return repr(value)
  escaped = str(value).replace('\\', '\\\\').replace('"', '\\"')
  return f'"{escaped}"'


# What `flwr run` prints of its own, besides Flower's log lines.
_FLWR_LINES = (
  'Using SuperLink',
  'Successfully',
  'Flower App configuration',
  '- Recommended',
)


def _own_line(line: str) -> bool:
  """Whether a line of `flwr run`'s stream is the App's own (not one of
  Flower's log lines, which are coloured, nor its notices)."""
  text = line.strip()
  return bool(text) and '\x1b[' not in line and not text.startswith(_FLWR_LINES)


def options(**values: object) -> list[str]:
  """Flower's command-line options for `values`: each name with two
  dashes and its underscores as hyphens, then its value (`True` alone:
  a switch; `None`: left out)."""
  args = []
  for name, value in values.items():
    if value is None:
      continue
    args.append('-' * 2 + name.replace('_', '-'))
    if value is not True:
      args.append(str(value))
  return args


def config_pairs(config: Mapping[str, object]) -> str:
  """`config` as Flower's space separated `key=value` pairs (TOML
  values)."""
  return ' '.join(f'{k}={_toml_value(v)}' for k, v in config.items())


class Remote(NamedTuple):
  """A SuperLink running elsewhere, to submit runs to (`Federation.attach`).

  Attributes:
    address: its `host:port`.
    root_certificates: the CA certificate file its TLS certificate is
      signed by; None: an insecure SuperLink.
    node_ids: node 0's Flower id, node 1's, …; empty: asked.
  """

  address: str
  root_certificates: str | None = None
  node_ids: tuple[int, ...] = ()


class Federation:
  """A SuperLink and `num_nodes` SuperNodes on this machine (see the
  module docstring).

  Args:
    folder: where credentials, Flower's home, logs and temporary files go.
    num_nodes: SuperNodes to start (>= 1).
    node_config: `node_config(i)`, SuperNode i's node config (its
      `key=value` pairs).
    host: the address the SuperLink listens on.
    insecure: no TLS and no node authentication.
    warm: the SuperLink and the SuperNodes in Flower's process isolation,
      each with a warm SuperExec (`warm.py`: App processes forked from an
      interpreter that has imported them); False: Flower's own launcher,
      a fresh process for every message.
    heartbeat_s: the heartbeat interval the SuperNodes ask for
      (`supernode.py`; the SuperLink counts a node offline, and fails
      the messages it holds for it, two intervals after its last beat);
      None: Flower's own, 30 s.
  """

  def __init__(
    self,
    folder: str,
    num_nodes: int,
    node_config: Callable[[int], Mapping[str, object]] = lambda i: {},
    *,
    host: str = '127.0.0.1',
    insecure: bool = False,
    warm: bool = True,
    heartbeat_s: float | None = None,
  ):
    if num_nodes < 1:
      raise ValueError(f'num_nodes must be >= 1, got {num_nodes}')
    low, high = HEARTBEAT_S
    if heartbeat_s is not None and not low <= heartbeat_s <= high:
      raise ValueError(
        f'heartbeat_s must be in [{low:g}, {high:g}] (what a SuperLink '
        f'accepts), got {heartbeat_s}'
      )
    self.folder = os.path.abspath(folder)
    self.num_nodes = num_nodes
    self.node_config = node_config
    self.host = host
    self.insecure = insecure
    self.warm = warm
    self.heartbeat_s = heartbeat_s
    self.home = os.path.join(self.folder, 'home')
    self.logs = os.path.join(self.folder, 'logs')
    self.port = None
    self.credentials = None
    self.nodes: list[subprocess.Popen | None] = []
    # Node i's Flower id (its registered key's; empty when insecure).
    self.node_ids: list[int] = []
    self._group = None
    self._processes: list[subprocess.Popen] = []
    # The warm SuperExecs: (log name, its process, its SuperLink's or
    # SuperNode's process).
    self._superexecs: list[tuple[str, subprocess.Popen, subprocess.Popen]] = []
    # Marks the environment of every process of this federation (and of
    # their children, those Flower starts in sessions of their own too).
    self.mark = f'{os.getpid()}-{uuid.uuid4().hex}'
    # Attached (`attach`): the CA certificate of a SuperLink elsewhere.
    self.attached = False
    self.root_certificates: str | None = None

  @classmethod
  def attach(
    cls,
    folder: str,
    address: str,
    num_nodes: int,
    *,
    root_certificates: str | None = None,
    node_ids: Sequence[int] = (),
  ) -> Federation:
    """A SuperLink running at `address` (`host:port`) with `num_nodes`
    SuperNodes, to submit runs to.

    Args:
      folder: where Flower's home and the logs of the runs go.
      address: the SuperLink's `host:port`.
      num_nodes: its SuperNodes (node config `node-index` 0 … N − 1).
      root_certificates: the CA certificate its TLS certificate is signed
        by; None: an insecure SuperLink (no TLS).
      node_ids: node 0's Flower id, node 1's, … (their registered keys'
        ids); empty: the server asks each node its index.

    Raises:
      ValueError: an address that is not `host:port`, or node ids that
        are not one per node.
    """
    host, _, port = address.rpartition(':')
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ValueError(f'address {address!r} is not host:port')
    if node_ids and len(node_ids) != num_nodes:
      raise ValueError(
        f'node_ids names {len(node_ids)} nodes, not num_nodes={num_nodes}'
      )
    fed = cls(folder, num_nodes, host=host, insecure=root_certificates is None)
    fed.port = int(port)
    fed.attached = True
    fed.root_certificates = root_certificates
    fed.node_ids = [int(n) for n in node_ids]
    return fed

  # Environment and processes.

  def env(self) -> dict[str, str]:
    """The environment of every federation process."""
    env = dict(os.environ)
    bin_dir = os.path.dirname(sys.executable)
    env['PATH'] = bin_dir + os.pathsep + env.get('PATH', '')
    env['FLWR_HOME'] = self.home
    env['FLWR_TELEMETRY_ENABLED'] = '0'
    env['FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION'] = '1'
    env['TMPDIR'] = os.path.join(self.folder, 'tmp')
    env[watchdog.MARK_VARIABLE] = self.mark
    # A node starts a process per message: compiled programs are kept
    # (JAX's persistent cache, bit-identical to compiling again).
    env.setdefault(
      'JAX_COMPILATION_CACHE_DIR', os.path.join(self.folder, 'jax')
    )
    env.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
    return env

  def _start(self, name: str, command: list[str]) -> subprocess.Popen:
    """Starts `command` in the federation's process group, its output
    in `logs/<name>.log`."""
    with open(os.path.join(self.logs, f'{name}.log'), 'ab') as out:
      process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        env=self.env(),
        cwd=self.folder,
        process_group=self._group,
      )
    self._processes.append(process)
    return process

  def _tool(self, name: str) -> str:
    return os.path.join(os.path.dirname(sys.executable), name)

  def _flwr(self, *args: str, timeout: float = START_TIMEOUT_S) -> str:
    """Runs the `flwr` command line with `args` against this federation;
    its output (raises `FederationError` when it fails)."""
    done = subprocess.run(
      [self._tool('flwr'), *args],
      stdin=subprocess.DEVNULL,
      capture_output=True,
      text=True,
      env=self.env(),
      cwd=self.folder,
      timeout=timeout,
      process_group=self._group,
    )
    if done.returncode:
      raise FederationError(
        f'flwr {args[0]} {args[1] if len(args) > 1 else ""} failed '
        f'({done.returncode}): {(done.stdout + done.stderr).strip()[-300:]}'
      )
    return done.stdout

  # Start.

  def start(self) -> Federation:
    """Starts the watchdog, the SuperLink and the SuperNodes; returns once
    the SuperLink answers and the nodes are started."""
    for path in (self.home, self.logs, os.path.join(self.folder, 'tmp')):
      os.makedirs(path, exist_ok=True)
    try:
      self._start_watchdog()
      if self.attached:
        self._write_cli_config()
        return self
      if not self.insecure:
        self.credentials = credentials_lib.make(
          os.path.join(self.folder, 'credentials'),
          self.num_nodes,
          (self.host,),
        )
      self.port = free_port(self.host)
      self._write_cli_config()
      self._start_superlink()
      self._wait_for_superlink()
      if not self.insecure:
        # One `flwr` process a key, a few at once (each mostly imports;
        # a large federation's hundred would not fit in memory together).
        keys = self.credentials.node_public_keys
        at_once = min(len(keys), 2 * (os.cpu_count() or 1))
        with futures.ThreadPoolExecutor(at_once) as pool:
          self.node_ids = list(pool.map(self._register, keys))
      self.nodes = [self.start_node(i) for i in range(self.num_nodes)]
    except BaseException:
      self.stop()
      raise
    return self

  def _register(self, public_key: str) -> int:
    """Registers a node's public key; the node id it gives."""
    out = self._flwr(
      'supernode', 'register', public_key, FEDERATION, *options(format='json')
    )
    try:
      return int(json.loads(out)['node-id'])
    except (ValueError, KeyError, TypeError):
      raise FederationError(
        f'flwr supernode register gave no node id: {out.strip()[-300:]}'
      ) from None

  def _start_watchdog(self) -> None:
    process = subprocess.Popen(
      [sys.executable, '-m', watchdog.__name__, str(os.getpid()), self.mark],
      stdin=subprocess.DEVNULL,
      # A group of its own in this session (others may join it), apart
      # from the terminal's: Ctrl-C reaches the program alone, which
      # then stops the group.
      process_group=0,
    )
    self._group = process.pid
    self._processes.append(process)

  def _write_cli_config(self) -> None:
    lines = [
      '[superlink]',
      f'default = "{FEDERATION}"',
      f'[superlink.{FEDERATION}]',
      f'address = "{self.address}"',
    ]
    if self.insecure:
      lines.append('insecure = true')
    else:
      ca = self.root_certificates or self.credentials.ca_cert
      lines.append(f'root-certificates = {_toml_value(os.path.abspath(ca))}')
    with open(os.path.join(self.home, 'config.toml'), 'w') as f:
      f.write('\n'.join(lines) + '\n')

  @property
  def address(self) -> str:
    """The SuperLink's `host:port`."""
    return f'{self.host}:{self.port}'

  def _tls_args(self) -> list[str]:
    if self.insecure:
      return options(insecure=True)
    c = self.credentials
    return options(
      ssl_ca_certfile=c.ca_cert,
      ssl_certfile=c.server_cert,
      ssl_keyfile=c.server_key,
      enable_supernode_auth=True,
    )

  def _start_superlink(self) -> None:
    self.superlink = self._start(
      'superlink',
      [
        self._tool('flower-superlink'),
        *self._tls_args(),
        *options(
          disable_runtime_dependency_installation=True,
          host=self.host,
          port=self.port,
          isolation='process' if self.warm else None,
        ),
      ],
    )
    if self.warm:
      ca = None if self.insecure else self.credentials.ca_cert
      self._start_superexec('superexec', self.address, self.superlink, ca)

  def _start_superexec(
    self,
    name: str,
    runtime_address: str,
    parent: subprocess.Popen,
    root_certificates: str | None = None,
  ) -> subprocess.Popen:
    """Starts the warm SuperExec (`warm.py`) of the SuperLink or of a
    SuperNode (`parent`) whose Runtime API is at `runtime_address`."""
    tls = (
      options(insecure=True)
      if root_certificates is None
      else options(root_certificates=root_certificates)
    )
    process = self._start(
      name,
      [sys.executable, '-m', WARM_SUPEREXEC, *tls]
      + options(runtime_api_address=runtime_address, parent_pid=parent.pid),
    )
    self._superexecs.append((name, process, parent))
    return process

  def _ended_superexec(self) -> str | None:
    """The log name of a warm SuperExec that ended while its SuperLink or
    SuperNode lives (nothing would start that one's App processes)."""
    for name, process, parent in self._superexecs:
      if process.poll() is not None and parent.poll() is None:
        return name
    return None

  def _wait_for_superlink(self) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
      if self.superlink.poll() is not None:
        raise FederationError(
          f'the SuperLink ended at start ({self.superlink.returncode}); see '
          f'{os.path.join(self.logs, "superlink.log")}'
        )
      try:
        socket.create_connection((self.host, self.port), timeout=1).close()
        return
      except OSError:
        time.sleep(0.25)
    raise FederationError(f'the SuperLink did not start in {START_TIMEOUT_S} s')

  def node_command(
    self,
    i: int,
    *,
    key: str | None = None,
    root_certificates: str | None = None,
    port: int | None = None,
  ) -> list[str]:
    """SuperNode i's command line, its Runtime API on `port` (a free
    one if None); `key`/`root_certificates` replace its own key and the CA
    certificate (tests start impostors with them)."""
    command = [self._tool('flower-supernode')]
    if self.heartbeat_s is not None:
      command = [sys.executable, '-m', SUPERNODE] + options(
        heartbeat_interval=self.heartbeat_s
      )
    command += options(
      superlink=self.address,
      node_config=config_pairs(self.node_config(i)),
      port=port or free_port(),
      max_retries=0,
      isolation='process' if self.warm else None,
    )
    if self.insecure:
      return command + options(insecure=True)
    c = self.credentials
    return command + options(
      root_certificates=root_certificates or c.ca_cert,
      auth_supernode_private_key=key or c.node_keys[i],
    )

  def start_node(self, i: int, **kwargs) -> subprocess.Popen:
    """Starts SuperNode i (again, after it ended: it rejoins), and its
    warm SuperExec, which ends with it."""
    port = free_port()
    node = self._start(
      f'supernode{i}', self.node_command(i, port=port, **kwargs)
    )
    if self.warm:
      self._start_superexec(f'superexec{i}', f'127.0.0.1:{port}', node)
    return node

  def node_list(self) -> list[dict[str, str]]:
    """The SuperLink's list of SuperNodes (`flwr supernode list`'s JSON:
    per node its `node-id`, `status`, `online-at`, `offline-at`, …)."""
    out = self._flwr('supernode', 'list', FEDERATION, *options(format='json'))
    return json.loads(out).get('nodes', [])

  def online_nodes(self) -> int:
    """SuperNodes the SuperLink lists as online."""
    return sum(1 for n in self.node_list() if n.get('status') == 'online')

  # Run and stop.

  def run(
    self,
    app_dir: str,
    run_config: Mapping[str, object],
    echo: Callable[[str], None] | None = None,
  ) -> None:
    """Submits the Flower App in `app_dir` with `run_config` and waits
    until the run ends; its output goes to `logs/run.log`, and the App's
    own lines (not Flower's log lines) to `echo` as well.

    Raises:
      FederationError: the run could not be submitted.
    """
    command = [self._tool('flwr'), 'run', app_dir, FEDERATION]
    command += options(stream=True, run_config=config_pairs(run_config))
    with open(os.path.join(self.logs, 'run.log'), 'a') as out:
      process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=self.env(),
        cwd=self.folder,
        process_group=self._group,
      )
      self._processes.append(process)
      ended = []

      def watch() -> None:
        while process.poll() is None:
          name = self._ended_superexec()
          if name is not None:
            ended.append(name)
            process.terminate()
            return
          time.sleep(1)

      threading.Thread(target=watch, daemon=True).start()
      for line in process.stdout:
        out.write(line)
        out.flush()
        if echo is not None and _own_line(line):
          echo(line.rstrip('\n'))
      code = process.wait()
    if ended:
      raise FederationError(
        f'the SuperExec of {ended[0]} ended; see '
        f'{os.path.join(self.logs, ended[0] + ".log")}'
      )
    if code:
      raise FederationError(
        f'flwr run failed ({code}); see {os.path.join(self.logs, "run.log")}'
      )

  def stop(self) -> None:
    """Stops every process of the federation (SIGTERM, then SIGKILL)."""
    if self._group is not None:
      watchdog.stop_group(self._group, self.mark)
      self._group = None
    for process in self._processes:
      try:
        process.wait(timeout=5)
      except subprocess.TimeoutExpired:
        process.kill()
    self._processes = []

  def __enter__(self) -> Federation:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()
