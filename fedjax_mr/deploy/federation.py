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
`insecure=True` runs without either (the caller warns). In both, the
SuperLink's Control API (runs, logs, node registration) obeys the
operator's token alone (`flower/superlink.py`; the registrations and node
lists go from this process, `flower/control.py`, and `flwr run` and `flwr
stop` send it from Flower's credential store in `home`), and every SuperExec
authenticates with a shared secret (Flower's process isolation and
its `superexec-auth-secret-file` option; a SuperExec without it gets no task).

`Federation.attach(folder, address, num_nodes, ...)` is a SuperLink
running elsewhere (a real fleet's): `start()` then starts nothing of the
federation, only what submits runs to it, and `stop()` stops only that.

Everything Flower writes stays in `folder`, which is its owner's alone
(0700): its home (`FLWR_HOME`), the processes' logs, temporary files.
Telemetry is off, runtime dependency installation (`uv sync`) is off
(the environment is this one, and it may be offline), and the processes
start from this Python's environment (its `bin` first on PATH, where
`flower-superexec` is).

Every process joins one process group, led by a watchdog
(`fedjax_mr/core/watchdog.py`) that stops the group when the program
that started it ends in any way, SIGKILL included.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Callable
from typing import Mapping
from typing import NamedTuple
from typing import Sequence

from fedjax_mr.core import watchdog
from fedjax_mr.deploy import credentials as credentials_lib
from fedjax_mr.deploy.flower import commands
from fedjax_mr.deploy.flower import control as control_lib
from fedjax_mr.deploy.flower import superlink as superlink_lib

# The warm SuperExec's module (`flower/warm.py`; it imports Flower and JAX).
WARM_SUPEREXEC = 'fedjax_mr.deploy.flower.warm'
# `flower-supernode` with intervals of its own (`flower/supernode.py`).
SUPERNODE = 'fedjax_mr.deploy.flower.supernode'
# `flower-superlink` obeying the operator's token (`flower/superlink.py`).
SUPERLINK = 'fedjax_mr.deploy.flower.superlink'
# The heartbeat intervals a SuperLink accepts, in s (Flower's MIN and MAX
# HEARTBEAT_..._INTERVAL; supernode.py reads them from Flower).
HEARTBEAT_S = (10.0, 1800.0)
# The poll intervals a SuperNode takes (`flower/supernode.py`); a local one's.
POLL_S = (0.05, 3.0)
LOCAL_POLL_S = 0.25

FEDERATION = 'local'  # the connection's name in Flower's config.toml
START_TIMEOUT_S = 120.0
# How long an attached SuperLink has to answer the first checks.
CHECK_TIMEOUT_S = 30.0


class FederationError(RuntimeError):
  """A federation process failed to start or a run failed; the message
  names the log to read."""


def free_port(host: str = '127.0.0.1') -> int:
  """A TCP port free on `host` now (the OS's choice)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


# Python's warnings filter (PYTHONWARNINGS) for JAX's failed cache writes.
_CACHE_WARNING = (
  'ignore:Error writing persistent compilation cache entry:UserWarning'
)


class Remote(NamedTuple):
  """A SuperLink running elsewhere, to submit runs to (`Federation.attach`).

  Attributes:
    address: its `host:port`.
    root_certificates: the CA certificate file its TLS certificate is
      signed by; None: an insecure SuperLink.
    node_ids: node 0's Flower id, node 1's, …; empty: asked.
    operator_token: the file of the operator's token its Control API
      accepts (`flower/superlink.py`); None: a SuperLink that asks for none.
  """

  address: str
  root_certificates: str | None = None
  node_ids: tuple[int, ...] = ()
  operator_token: str | None = None


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
    warm: the SuperExecs started beside the SuperLink and each SuperNode
      (all in Flower's process isolation) are warm (`flower/warm.py`: App
      processes forked from an interpreter that has imported them);
      False: Flower's own `flower-superexec`, a fresh process for every
      message.
    heartbeat_s: the heartbeat interval the SuperNodes ask for
      (`flower/supernode.py`; the SuperLink counts a node offline, and fails
      the messages it holds for it, two intervals after its last beat);
      None: Flower's own, 30 s.
    poll_s: the longest a SuperNode and a SuperExec wait between looks for
      work (`flower/supernode.py`; Flower's FLWR_SUPEREXEC_TASK_POLL_INTERVAL);
      None: Flower's own, 3 s and 1 s; `launch`'s federation: LOCAL_POLL_S.
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
    poll_s: float | None = None,
  ):
    if num_nodes < 1:
      raise ValueError(f'num_nodes must be >= 1, got {num_nodes}')
    for name, value, (low, high) in (
      ('heartbeat_s', heartbeat_s, HEARTBEAT_S),
      ('poll_s', poll_s, POLL_S),
    ):
      if value is not None and not low <= value <= high:
        raise ValueError(f'{name} must be in [{low:g}, {high:g}], got {value}')
    self.folder = os.path.abspath(folder)
    self.num_nodes = num_nodes
    self.node_config = node_config
    self.host = host
    self.insecure = insecure
    self.warm = warm
    self.heartbeat_s = heartbeat_s
    self.poll_s = poll_s
    self.home = os.path.join(self.folder, 'home')
    self.logs = os.path.join(self.folder, 'logs')
    self.port = None
    self.credentials = None
    # The operator's token and the SuperExecs' secret (`make_secrets`);
    # attached: the operator's token file given, if any.
    self.secrets: credentials_lib.Secrets | None = None
    self.operator_token: str | None = None
    self.nodes: list[subprocess.Popen | None] = []
    # Node i's Flower id (its registered key's; empty when insecure).
    self.node_ids: list[int] = []
    self._group = None
    self._processes: list[subprocess.Popen] = []
    # The SuperExecs: (log name, its process, its SuperLink's or
    # SuperNode's process).
    self._superexecs: list[tuple[str, subprocess.Popen, subprocess.Popen]] = []
    # Marks the environment of every process of this federation (and of
    # their children, those Flower starts in sessions of their own too).
    self.mark = f'{os.getpid()}-{uuid.uuid4().hex}'
    # Attached (`attach`): the CA certificate of a SuperLink elsewhere.
    self.attached = False
    self.root_certificates: str | None = None
    # The run submitted and not yet ended (its id), and what the
    # watchdog runs if this process dies meanwhile (stop it there).
    self.running: int | None = None
    self._last_words = os.path.join(self.folder, 'last_words.json')
    # The result the run's ServerApp printed, where it could not write
    # its file (`commands.result_line`).
    self.streamed_result: dict | None = None
    self._control_api: control_lib.Control | None = None

  @classmethod
  def attach(
    cls,
    folder: str,
    address: str,
    num_nodes: int,
    *,
    root_certificates: str | None = None,
    node_ids: Sequence[int] = (),
    operator_token: str | None = None,
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
      operator_token: the file of the operator's token its Control API
        accepts (`flower/superlink.py`); None: it asks for none.

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
    fed.operator_token = operator_token
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
    if self.poll_s is not None:
      env['FLWR_SUPEREXEC_TASK_POLL_INTERVAL'] = repr(self.poll_s)
    # A node starts a process per message: compiled programs are kept
    # (JAX's persistent cache, bit-identical to compiling again).
    env.setdefault(
      'JAX_COMPILATION_CACHE_DIR', os.path.join(self.folder, 'jax')
    )
    env.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
    # A program the cache cannot keep (a full disk) is compiled again,
    # bit for bit: not worth a warning on the terminal per program.
    env['PYTHONWARNINGS'] = ','.join(
      w for w in (env.get('PYTHONWARNINGS'), _CACHE_WARNING) if w
    )
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
    said = (done.stdout + done.stderr).strip()
    if done.returncode or '"success": false' in done.stdout:
      # JSON output (`format='json'`) exits 0 on a refusal; its JSON says so.
      raise FederationError(
        f'flwr {args[0]} {args[1] if len(args) > 1 else ""} failed '
        f'({done.returncode}): {said[-300:]}'
      )
    return done.stdout

  # Start.

  def start(self) -> Federation:
    """Starts the watchdog, the SuperLink and the SuperNodes; returns once
    the SuperLink answers and the nodes are started."""
    for path in (
      self.folder,
      self.home,
      self.logs,
      os.path.join(self.folder, 'tmp'),
    ):
      credentials_lib.private_folder(path)
    try:
      self._start_watchdog()
      if self.attached:
        self._write_cli_config()
        self._check_remote()
        return self
      self.secrets = credentials_lib.make_secrets(
        os.path.join(self.folder, 'credentials')
      )
      self.operator_token = self.secrets.operator_token
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
        # In this process, one request a key (`flower/control.py`).
        keys = self.credentials.node_public_keys
        try:
          self.node_ids = [self._control().register(k) for k in keys]
        except control_lib.ControlError as e:
          raise FederationError(f'registering the nodes: {e}') from None
      self.nodes = [self.start_node(i) for i in range(self.num_nodes)]
    except BaseException:
      self.stop()
      raise
    return self

  def _check_remote(self) -> None:
    """Checks that the SuperLink attached to answers at its address with
    a certificate the CA signed, obeys the operator's token and has
    registered the node ids given (within CHECK_TIMEOUT_S)."""
    host, port = self.host.strip('[]'), self.port
    try:
      with socket.create_connection((host, port), CHECK_TIMEOUT_S) as s:
        if self.root_certificates is not None:
          try:
            credentials_lib.check_server(s, host, self.root_certificates)
          except ValueError as e:
            raise FederationError(str(e)) from None
    except OSError as e:
      raise FederationError(
        f'no SuperLink answers at {self.address}: {e.strerror or e}'
      ) from None
    try:
      nodes = self._control().nodes()
    except control_lib.ControlTimeout:
      raise FederationError(
        f'the SuperLink at {self.address} did not answer in '
        f'{CHECK_TIMEOUT_S:g} s'
      ) from None
    except control_lib.ControlError as e:
      if control_lib.AUTHENTICATION_FAILED in str(e):
        raise FederationError(
          f'the SuperLink at {self.address} refused the operator token'
        ) from None
      raise FederationError(f'the SuperLink at {self.address}: {e}') from None
    registered = {int(n['node-id']) for n in nodes}
    missing = [n for n in self.node_ids if n not in registered]
    if missing:
      raise FederationError(
        f'node ids {",".join(map(str, missing))} are not registered at the '
        f'SuperLink at {self.address}'
      )

  def _control(self) -> control_lib.Control:
    """The SuperLink's Control API, as the operator (`flower/control.py`)."""
    if self._control_api is None:
      try:
        self._control_api = control_lib.Control(
          self.address, self._ca(), self.operator_token, CHECK_TIMEOUT_S
        )
      except ValueError as e:
        raise FederationError(
          f'the operator token file {self.operator_token}: {e}'
        ) from None
    return self._control_api

  def _start_watchdog(self) -> None:
    process = subprocess.Popen(
      [
        sys.executable,
        '-m',
        watchdog.__name__,
        str(os.getpid()),
        self.mark,
        self._last_words,
      ],
      stdin=subprocess.DEVNULL,
      # A group of its own in this session (others may join it), apart
      # from the terminal's: Ctrl-C reaches the program alone, which
      # then stops the group.
      process_group=0,
    )
    self._group = process.pid
    self._processes.append(process)

  def _ca(self) -> str | None:
    """The CA certificate file the SuperLink's is signed by (None: no TLS)."""
    if self.insecure:
      return None
    return self.root_certificates or self.credentials.ca_cert

  def _write_cli_config(self) -> None:
    try:
      superlink_lib.operator_home(
        self.home, self.address, self._ca(), self.operator_token, FEDERATION
      )
    except ValueError as e:
      raise FederationError(
        f'the operator token file {self.operator_token}: {e}'
      ) from None

  @property
  def address(self) -> str:
    """The SuperLink's `host:port`."""
    return f'{self.host}:{self.port}'

  def _tls_args(self) -> list[str]:
    if self.insecure:
      return commands.options(insecure=True)
    c = self.credentials
    return commands.options(
      ssl_ca_certfile=c.ca_cert,
      ssl_certfile=c.server_cert,
      ssl_keyfile=c.server_key,
      enable_supernode_auth=True,
    )

  def _start_superlink(self) -> None:
    # Process isolation: the SuperExec is started here, with the secret
    # (Flower's own, started by the SuperLink, would have none).
    self.superlink = self._start(
      'superlink',
      [
        sys.executable,
        '-m',
        SUPERLINK,
        *commands.options(operator_token_file=self.secrets.operator_token),
        *self._tls_args(),
        *commands.options(
          disable_runtime_dependency_installation=True,
          host=self.host,
          port=self.port,
          isolation='process',
          superexec_auth_secret_file=self.secrets.superexec_secret,
        ),
      ],
    )
    ca = None if self.insecure else self.credentials.ca_cert
    self._start_superexec('superexec', self.address, self.superlink, ca)

  def _start_superexec(
    self,
    name: str,
    runtime_address: str,
    parent: subprocess.Popen,
    root_certificates: str | None = None,
  ) -> subprocess.Popen:
    """Starts the SuperExec of the SuperLink or of a SuperNode (`parent`)
    whose Runtime API is at `runtime_address`: the warm one (`flower/warm.py`),
    or Flower's `flower-superexec` if not `warm`; with the secret."""
    tls = (
      commands.options(insecure=True)
      if root_certificates is None
      else commands.options(root_certificates=root_certificates)
    )
    program = (
      [sys.executable, '-m', WARM_SUPEREXEC]
      if self.warm
      else [self._tool('flower-superexec')]
    )
    process = self._start(
      name,
      program
      + tls
      + commands.options(
        runtime_api_address=runtime_address,
        parent_pid=parent.pid,
        superexec_auth_secret_file=self.secrets.superexec_secret,
      ),
    )
    self._superexecs.append((name, process, parent))
    return process

  def _ended_superexec(self) -> str | None:
    """The log name of a SuperExec that ended while its SuperLink or
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
    if self.heartbeat_s is not None or self.poll_s is not None:
      command = [sys.executable, '-m', SUPERNODE] + commands.options(
        heartbeat_interval=self.heartbeat_s, poll_interval=self.poll_s
      )
    command += commands.options(
      superlink=self.address,
      node_config=commands.config_pairs(self.node_config(i)),
      port=port or free_port(),
      max_retries=0,
      isolation='process',
      superexec_auth_secret_file=self.secrets.superexec_secret,
    )
    if self.insecure:
      return command + commands.options(insecure=True)
    c = self.credentials
    return command + commands.options(
      root_certificates=root_certificates or c.ca_cert,
      auth_supernode_private_key=key or c.node_keys[i],
    )

  def start_node(self, i: int, **kwargs) -> subprocess.Popen:
    """Starts SuperNode i (again, after it ended: it rejoins), and its
    SuperExec, which ends with it."""
    port = free_port()
    node = self._start(
      f'supernode{i}', self.node_command(i, port=port, **kwargs)
    )
    self._start_superexec(f'superexec{i}', f'127.0.0.1:{port}', node)
    return node

  def node_list(self) -> list[dict[str, str]]:
    """The SuperLink's list of SuperNodes (`flwr supernode list`'s JSON:
    per node its `node-id`, `status`, `online-at`, `offline-at`, …)."""
    try:
      return self._control().nodes()
    except control_lib.ControlError as e:
      raise FederationError(f'listing the SuperNodes: {e}') from None

  def online_nodes(self) -> int:
    """SuperNodes the SuperLink lists as online."""
    return sum(1 for n in self.node_list() if n.get('status') == 'online')

  # Run and stop.

  def run(
    self,
    app_dir: str,
    run_config: Mapping[str, object],
    echo: Callable[[str], None] | None = None,
    every_line: bool = False,
  ) -> None:
    """Submits the Flower App in `app_dir` with `run_config` and waits
    until the run ends; its output goes to `logs/run.log`, and the App's
    own lines (not Flower's log lines, unless `every_line`) to `echo` as
    well.

    Raises:
      FederationError: the run could not be submitted.
    """
    command = [self._tool('flwr'), 'run', app_dir, FEDERATION]
    command += commands.options(
      stream=True, run_config=commands.config_pairs(run_config)
    )
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
      self.streamed_result = None
      log = commands.RunLog(out, echo)
      for line in process.stdout:
        log.keep(line)
        self._note_run(line)
        self.streamed_result = (
          commands.read_result(line) or self.streamed_result
        )
        if every_line or commands.own_line(line):
          log.echo(line.rstrip('\n'))
      code = process.wait()
    self.running = None
    watchdog.write_last_words(self._last_words, None)
    if ended:
      raise FederationError(
        f'the SuperExec of {ended[0]} ended; see '
        f'{os.path.join(self.logs, ended[0] + ".log")}'
      )
    if code:
      raise FederationError(
        f'flwr run failed ({code}); see {os.path.join(self.logs, "run.log")}'
      )

  def _note_run(self, line: str) -> None:
    """Notes the id of the run `flwr run` says it started; attached, the
    watchdog is told to stop it at the SuperLink if this process dies."""
    found = commands.STARTED.search(line)
    if found is None:
      return
    self.running = int(found.group(1))
    if self.attached:
      watchdog.write_last_words(
        self._last_words,
        [self._tool('flwr'), 'stop', str(self.running), FEDERATION],
        {'FLWR_HOME': self.home},
      )

  def stop(self) -> None:
    """Stops every process of the federation (SIGTERM, then SIGKILL);
    attached, a run it submitted that has not ended is stopped at the
    SuperLink first."""
    if self.attached and self.running is not None and self._group:
      try:
        self._flwr('stop', str(self.running), FEDERATION, timeout=60)
      except (FederationError, subprocess.SubprocessError):
        pass  # the watchdog's last words try again
      else:
        watchdog.write_last_words(self._last_words, None)
      self.running = None
    if self._control_api is not None:
      self._control_api.close()
      self._control_api = None
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
