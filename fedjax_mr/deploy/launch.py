"""One federated run on a local Flower federation: `run(config, nodes)`,
a training run or a FedStitch run.

Checks the config and the workdir (nothing is written before a run can
start), then starts a SuperLink and `nodes` SuperNodes on this machine
(`federation.Federation`, files in `<workdir>/flower`), submits the Flower
App (`serverapp.py`, `clientapp.py`) and waits for it: the ServerApp runs
`experiments.run`'s host loop over the federation and writes the same
workdir (metrics, clients rows, checkpoints, provenance; a workdir with a
checkpoint resumes). Every process is stopped when the run ends, fails or
is interrupted, and when the calling process is killed (the federation's
watchdog). Given a running federation (`federation=`), the run is
submitted to it instead, and the federation is left running: one
federation serves many runs (each node keeps each run's client state
apart, `node.run_folder`).
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import time
from typing import Callable

from fedjax_mr.core import errors
from fedjax_mr.core import workdir as workdir_lib
from fedjax_mr.deploy import adapter
from fedjax_mr.deploy import federation as federation_lib
from fedjax_mr.deploy.flower import superlink as superlink_lib
from fedjax_mr.pipeline import resume

FOLDER = 'flower'  # the federation's files, inside the workdir
# How long a run stopped at a SuperLink elsewhere has to release the
# workdir (its server checkpoints the round in flight first).
RELEASE_TIMEOUT_S = 120.0
RESULT = 'result.json'

_APP = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedjax-mr-deploy"
version = "1.0.0"
description = "fedjax_mr's algorithms on a Flower federation"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "fedjax-mr"

[tool.flwr.app.components]
serverapp = "fedjax_mr.deploy.serverapp:server_app"
clientapp = "fedjax_mr.deploy.clientapp:client_app"

[tool.flwr.app.config]
spec = ""
workdir = ""
result = ""
num-nodes = 1
node-ids = ""
round-timeout = 0.0
"""

EXPOSED = (
  'exposed: the SuperLink listens on {address} for every machine that '
  'reaches it; TLS, the operator token and the registered node keys keep '
  'out the others (insecure={insecure}: none of that if True)'
)
INSECURE_WARNING = (
  'warning: an insecure federation: no TLS and no node authentication; '
  'anyone who reaches {address} can join it and read the models'
)


def write_app(folder: str) -> str:
  """Writes the Flower App's pyproject.toml into `folder`; the folder."""
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, 'pyproject.toml'), 'w') as f:
    f.write(_APP)
  return folder


def node_config(
  folder: str, nodes: int, insecure: bool = False
) -> Callable[[int], dict]:
  """The node config of node i of a local federation in `folder`: its
  index, the number of nodes, its state folder and, unless `insecure`,
  its key (which signs its clients' secure-aggregation keys) and the
  roster of the nodes' public keys (which checks the others'), as the
  federation makes them (`credentials.make`)."""

  def config(i: int) -> dict:
    made = {
      'node-index': i,
      'num-nodes': nodes,
      'state': os.path.join(folder, 'nodes', f'node{i}'),
    }
    if not insecure:
      made['signing-key'] = os.path.join(folder, 'credentials', f'node{i}.key')
      made['roster'] = os.path.join(folder, 'credentials', 'roster.json')
    return made

  return config


def run(
  config: adapter.Config | adapter.StitchConfig,
  nodes: int,
  *,
  round_timeout: float = 0.0,
  insecure: bool = False,
  host: str = '127.0.0.1',
  log: Callable[[str], None] = print,
  federation: federation_lib.Federation | None = None,
  superlink: federation_lib.Remote | None = None,
  warm: bool = True,
  node_heartbeat_s: float = 0.0,
  expose: bool = False,
  flower_logs: bool = False,
) -> str:
  """Runs (or resumes) `config` on a local federation of `nodes` nodes
  (or on a running one); returns the workdir.

  Args:
    config: the run: a training run (`experiments.run`'s flags) or a
      FedStitch run (`experiments.stitch`'s `StitchConfig`, each node
      scoring its clients' candidates on its own pool and data).
    nodes: SuperNodes (node i serves clients i, i + nodes, …).
    round_timeout: seconds a round waits for replies (0: no deadline);
      clients without a reply by then count as failed.
    insecure: no TLS and no node authentication (a warning is logged).
    host: the SuperLink's address: a loopback one unless `expose`.
    log: where progress lines go.
    federation: a running federation (started with `node_config`) to
      submit the run to; `nodes`, `insecure` and `host` are its own.
    superlink: a SuperLink running elsewhere (a real fleet's, whose
      `nodes` nodes have the node configs `node_config` gives) to submit
      the run to; `insecure` must say whether it is; `host` is unused.
    warm: the federation started here has warm SuperExecs
      (`federation.Federation`'s `warm`).
    node_heartbeat_s: its SuperNodes' heartbeat interval (its
      `heartbeat_s`); 0: Flower's 30 s.
    expose: the SuperLink started here may listen on a `host` that other
      machines reach (a line says what that exposes, and to whom).
    flower_logs: Flower's own log lines go to `log` too (they are always
      in `<workdir>/flower/logs`).

  Raises:
    UserError: a bad argument or config field (named), the workdir, or
      the run's own failure (one line).
  """
  _check_arguments(nodes, round_timeout, federation)
  _check_host(host, expose, federation or superlink)
  _check_heartbeat(node_heartbeat_s, federation, superlink)
  _check_superlink(superlink, nodes, insecure, federation)
  workdir, write = _check_config(config, superlink)
  folder = os.path.join(os.path.abspath(workdir), FOLDER)
  # SIGTERM as Ctrl-C: the federation (or the run at `superlink`) stops.
  with resume.TerminationAsInterrupt(), workdir_lib.acquire(folder, 'workdir'):
    spec, app, result = _prepare(config, write, folder)
    fed = federation
    if fed is None:
      fed = _start(
        folder, nodes, host, insecure, superlink, warm, node_heartbeat_s, log
      )
    try:
      log(f'federation: a SuperLink on {fed.address}, {nodes} SuperNodes')
      if expose and fed is not federation and superlink is None:
        log(EXPOSED.format(address=fed.address, insecure=insecure))
      run_config = {
        'spec': spec,
        'workdir': os.path.abspath(workdir),
        'result': result,
        'num-nodes': nodes,
        'node-ids': ','.join(map(str, fed.node_ids)),
        'round-timeout': float(round_timeout),
      }
      _run(fed, app, run_config, log, flower_logs)
    finally:
      if federation is None:
        fed.stop()
      if superlink is not None:
        wait_released(workdir)
    _check_result(result, fed)
  return workdir


def _prepare(config, write: Callable[..., str], folder: str) -> tuple:
  """Writes the run's spec and the App into `folder` and removes an
  earlier run's result; (spec folder, App folder, result path)."""
  spec = os.path.dirname(write(config, os.path.join(folder, 'spec')))
  app = write_app(os.path.join(folder, 'app'))
  result = os.path.join(folder, RESULT)
  if os.path.exists(result):
    os.remove(result)
  return spec, app, result


def wait_released(workdir: str, timeout: float = RELEASE_TIMEOUT_S) -> bool:
  """Waits until no process holds `workdir`'s lock (a stopped run's
  server saves the round it is in first), for at most `timeout` s;
  whether it was released."""
  deadline = time.monotonic() + timeout
  while True:
    try:
      workdir_lib.check_free(workdir)
      return True
    except errors.ConfigError:
      if time.monotonic() > deadline:
        return False
      time.sleep(0.5)


def _run(
  fed: federation_lib.Federation,
  app: str,
  run_config: dict,
  log: Callable[[str], None],
  flower_logs: bool,
) -> None:
  """`fed.run`, its failure (a process of the federation that ended, the
  run not submitted) one line."""
  try:
    fed.run(app, run_config, echo=log, every_line=flower_logs)
  except federation_lib.FederationError as e:
    raise errors.UserError(str(e)) from None


def _check_arguments(
  nodes: int,
  round_timeout: float,
  federation: federation_lib.Federation | None,
) -> None:
  if nodes < 1:
    raise errors.ConfigError(f'`nodes={nodes}` must be >= 1')
  if not math.isfinite(round_timeout) or round_timeout < 0:
    raise errors.ConfigError(
      f'`round_timeout={round_timeout}` must be finite and >= 0 (0: none)'
    )
  if federation is not None and federation.num_nodes != nodes:
    raise errors.ConfigError(
      f"`nodes={nodes}` is not the federation's {federation.num_nodes}"
    )


def _check_host(host: str, expose: bool, running: object) -> None:
  """A SuperLink started here listens on a loopback `host`, unless
  `expose`."""
  if running is not None:
    return
  try:
    loopback = ipaddress.ip_address(host).is_loopback
  except ValueError:
    loopback = host == 'localhost'
  if not loopback and not expose:
    # Named as the programs' flags are (`federation_host`).
    raise errors.ConfigError(
      f'`federation_host={errors.clip(host)}` is reached from other '
      'machines, not only this one; pass `expose_federation` to mean it'
    )


def _check_config(
  config: adapter.Config | adapter.StitchConfig,
  superlink: federation_lib.Remote | None,
) -> tuple[str, Callable[..., str]]:
  """`config`'s workdir (checked) and the function that writes it."""
  if isinstance(config, adapter.StitchConfig):
    workdir = adapter.check_stitch(config, local_nodes=superlink is None)
    return workdir, adapter.write_stitch_config
  return adapter.check(config), adapter.write_config


def _check_heartbeat(
  node_heartbeat_s: float,
  federation: federation_lib.Federation | None,
  superlink: federation_lib.Remote | None,
) -> None:
  low, high = federation_lib.HEARTBEAT_S
  if node_heartbeat_s != 0 and not low <= node_heartbeat_s <= high:
    raise errors.ConfigError(
      f"`node_heartbeat_s={node_heartbeat_s}` must be 0 (Flower's 30 s) "
      f'or {low:g} to {high:g} (what a SuperLink accepts)'
    )
  if node_heartbeat_s and (federation is not None or superlink is not None):
    raise errors.ConfigError(
      '`node_heartbeat_s` is for the SuperNodes started here; a running '
      "federation's nodes beat as they were started"
    )


def _start(
  folder: str,
  nodes: int,
  host: str,
  insecure: bool,
  superlink: federation_lib.Remote | None,
  warm: bool = True,
  node_heartbeat_s: float = 0.0,
  log: Callable[[str], None] = print,
) -> federation_lib.Federation:
  """A federation of `nodes` nodes started on `host` (files in `folder`),
  or what submits runs to `superlink`; an insecure one's warning to
  `log` first."""
  if insecure:
    where = host if superlink is None else superlink.address
    log(INSECURE_WARNING.format(address=where))
  if superlink is not None:
    fed = federation_lib.Federation.attach(
      folder,
      superlink.address,
      nodes,
      root_certificates=superlink.root_certificates,
      node_ids=superlink.node_ids,
      operator_token=superlink.operator_token,
    )
  else:
    fed = federation_lib.Federation(
      folder,
      nodes,
      node_config(folder, nodes, insecure),
      host=host,
      insecure=insecure,
      warm=warm,
      heartbeat_s=node_heartbeat_s or None,
      poll_s=federation_lib.LOCAL_POLL_S,
    )
  try:
    return fed.start()
  except federation_lib.FederationError as e:  # one line
    raise errors.UserError(str(e)) from None


def _check_superlink(
  superlink: federation_lib.Remote | None,
  nodes: int,
  insecure: bool,
  federation: federation_lib.Federation | None,
) -> None:
  if superlink is None:
    return
  if federation is not None:
    raise errors.ConfigError('a run goes to `superlink` or `federation`')
  where = f'`superlink={errors.clip(superlink.address)}`'
  if superlink.node_ids and len(superlink.node_ids) != nodes:
    raise errors.ConfigError(
      f'`node_ids` names {len(superlink.node_ids)} nodes; `nodes={nodes}`'
    )
  try:
    federation_lib.Federation.attach('.', superlink.address, nodes)
  except ValueError as e:
    raise errors.ConfigError(f'{where}: {e}') from None
  ca = superlink.root_certificates
  if ca is None and not insecure:
    raise errors.ConfigError(
      f'{where}: without `root_certificates` (its CA certificate) the run '
      'would go to it without TLS; pass `insecure_federation` to mean it'
    )
  if ca is not None and insecure:
    raise errors.ConfigError(
      '`insecure_federation` and `root_certificates` contradict each other'
    )
  if ca is not None and not os.path.isfile(ca):
    raise errors.ConfigError(
      f'`root_certificates={errors.clip(ca)}`: no such file'
    )
  token = superlink.operator_token
  if token is not None and insecure:
    raise errors.ConfigError(
      '`operator_token` would cross the network in the clear to a '
      'SuperLink without TLS; give its `root_certificates` instead of '
      '`insecure_federation`'
    )
  if ca is not None and token is None:
    raise errors.ConfigError(
      f'{where}: without `operator_token` (the file of the token its '
      'Control API accepts) the run would go to a SuperLink anyone with '
      'its CA certificate commands'
    )
  if token is not None:
    try:
      superlink_lib.read_token(token)
    except ValueError as e:
      raise errors.ConfigError(
        f'`operator_token={errors.clip(token)}`: {e}'
      ) from None
  if ca is not None and not superlink.node_ids:
    raise errors.ConfigError(
      f'{where}: `node_ids` must name the registered node of each index '
      '(a node is never believed about its own index)'
    )


def _check_result(path: str, fed: federation_lib.Federation) -> None:
  try:
    with open(path) as f:
      result = json.load(f)
  except (OSError, ValueError):
    # What the ServerApp could not write, it said in the run's stream.
    result = fed.streamed_result
  if result is None:
    raise errors.UserError(
      f'the run ended without a result; see {os.path.join(fed.logs, "run.log")}'
    )
  if 'error' in result:
    raise errors.UserError(str(result['error']))
