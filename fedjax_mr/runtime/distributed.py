"""Devices, meshes and processes for sharding the client axis.

One process: the client axis of a round is sharded over the local devices
(GPUs, TPU cores, or XLA host devices on CPU). Several processes (hosts):
`initialize` joins JAX's distributed runtime, `jax.devices()` then lists
every process's devices, and the same jit-compiled round runs everywhere
with the data and the state replicated; each process trains its slice of
the client axis.

`mesh_for(config.devices, K)` gives a run its mesh, `client_mapping` says
how its clients are laid onto the devices (which decides the order of the
sums over clients), and `reproducibility_note` what the backend cannot
promise.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
import warnings
from typing import Any
from typing import Callable
from typing import Mapping

import jax
import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.models import layers

AXIS = 'clients'


def auto_host_devices(clients_per_round: int) -> int:
  """One host device per CPU core this process may use, at most K.

  K need not be a multiple: the round fills the client axis up with empty
  clients (see `engine.make_round_fn`).
  """
  cores = (
    len(os.sched_getaffinity(0))
    if hasattr(os, 'sched_getaffinity')
    else (os.cpu_count() or 1)
  )
  return max(1, min(cores, int(clients_per_round)))


MAX_HOST_DEVICES = 256

# glibc's malloc gives threads arenas of their own, up to 8 per core, and
# keeps what they freed. With several host devices more XLA threads
# allocate at once, and the default run's peak on 2 devices was 7-29 %
# above 1 device's, in memory freed but kept; two arenas keep it within
# 10 %, for 3-7 % more round time. On 1 device the cap made rounds about
# 11 % slower (BUILD.md "Scale"), so only several host devices get it.
MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's malloc.h


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
  """Caps glibc's malloc arenas at `arenas` (process-wide; best before
  the backend starts its threads) unless the environment sets
  MALLOC_ARENA_MAX, which glibc reads itself. False where it did not: the
  environment's setting, a C library without `mallopt` (not glibc), or a
  refusal."""
  if os.environ.get('MALLOC_ARENA_MAX'):
    return False
  try:
    mallopt = ctypes.CDLL(None).mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
  return mallopt(_M_ARENA_MAX, arenas) == 1


# How long a process waits for all the others to join (JAX's own default;
# past its timeout, JAX's runtime ends the process from C++, SIGABRT,
# without a word, so `join` gives up first).
COORDINATOR_TIMEOUT_S = 300.0


def initialize(
  *,
  host_devices: int = 0,
  num_devices: int = 0,
  clients_per_round: int = 1,
  coordinator_address: str = '',
  num_processes: int = 1,
  process_id: int = 0,
  coordinator_timeout: float = COORDINATOR_TIMEOUT_S,
  log: Callable[[str], None] = print,
) -> None:
  """Sets up devices and processes; call before any JAX computation.

  Args:
    host_devices: XLA host (CPU) devices per process; 0 picks
      `num_devices` if that is set, else
      `auto_host_devices(clients_per_round)`. Only affects the CPU backend.
    num_devices: the devices the client axis will be sharded over (0: all).
    clients_per_round: K, for the automatic choice.
    coordinator_address: `host:port` of process 0; empty for one process.
    num_processes: number of cooperating processes.
    process_id: this process's index.
    coordinator_timeout: seconds to wait for every process to join.
    log: where the line saying what it waits for goes.

  With several host devices it also caps glibc's malloc arenas
  (`limit_malloc_arenas`).

  Raises:
    ArgumentError: a bad process setting, naming its argument
      (`check_processes`).
    ConfigError: not every process joined within `coordinator_timeout`
      seconds (see `join`).
  """
  check_processes(
    num_processes, process_id, coordinator_address, coordinator_timeout
  )
  n = host_devices or num_devices or auto_host_devices(clients_per_round)
  # More host devices than this only time-slice one CPU host; a mesh of
  # `num_devices` beyond it is refused when the mesh is made.
  n = min(n, MAX_HOST_DEVICES)
  flags = os.environ.get('XLA_FLAGS', '')
  if 'xla_force_host_platform_device_count' not in flags:
    os.environ['XLA_FLAGS'] = (
      f'{flags} --xla_force_host_platform_device_count={n}'.strip()
    )
  if n > 1:
    limit_malloc_arenas()
  if num_processes > 1 and not jax.distributed.is_initialized():
    join(
      coordinator_address, num_processes, process_id, coordinator_timeout, log
    )


# The longest `coordinator_timeout`: a day.
MAX_COORDINATOR_TIMEOUT_S = 86_400


def check_processes(
  num_processes: int,
  process_id: int,
  coordinator_address: str,
  coordinator_timeout: float,
) -> None:
  """Raises `ArgumentError` naming `process_id` unless it is in
  `[0, num_processes)`, `coordinator_timeout` unless it is in (0, a day]
  seconds, or, with several processes, `coordinator_address` unless it is
  `host:port` (what `initialize` takes)."""
  if not 0 <= process_id < num_processes:
    raise errors.ArgumentError(
      'process_id',
      f'must be in [0, `num_processes={num_processes}`), got {process_id}',
    )
  if not 0 < coordinator_timeout <= MAX_COORDINATOR_TIMEOUT_S:  # nan too
    raise errors.ArgumentError(
      'coordinator_timeout',
      f'must be in (0, {MAX_COORDINATOR_TIMEOUT_S}] seconds, got '
      f'{coordinator_timeout}',
    )
  if num_processes > 1:
    host, sep, port = coordinator_address.rpartition(':')
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
      raise errors.ArgumentError(
        'coordinator_address',
        'must be host:port (e.g. 10.0.0.1:1234) with '
        f'`num_processes={num_processes}`, got {coordinator_address!r}',
      )


def join(
  address: str,
  num_processes: int,
  process_id: int,
  timeout_s: float,
  log: Callable[[str], None] = print,
) -> None:
  """Joins JAX's distributed runtime, saying first what this process waits
  for; gives up after `timeout_s` seconds.

  `jax.distributed.initialize` waits in C++ until every process has
  registered (process 0 runs the coordinator), deaf to Ctrl-C, and at its
  own timeout aborts the process. So it runs in a thread (it releases the
  GIL) with a day more than ours, and this thread waits for it up to
  `timeout_s`. A process that gave up (or was interrupted) cannot join
  again, and ends at once when it exits (`_exit_without_teardown`).

  Raises:
    ConfigError: not every process joined in time; naming the address,
      the processes and `coordinator_timeout`.
  """
  me = f'process {process_id} of {num_processes}'
  if process_id == 0:
    what = f'the {num_processes - 1} other process(es) to join its coordinator'
  else:
    what = 'the coordinator (process 0) and every other process'
  log(f'{me}: waiting up to {timeout_s:g} s for {what} at {address}')
  done = threading.Event()
  failed = []

  def connect():
    try:
      jax.distributed.initialize(
        coordinator_address=address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=int(timeout_s) + 86_400,
      )
    except Exception as e:  # noqa: BLE001 - raised in the caller's thread
      failed.append(e)
    finally:
      done.set()

  threading.Thread(target=connect, name='join', daemon=True).start()
  try:
    joined = done.wait(timeout_s)
  except KeyboardInterrupt:  # Ctrl-C works while it waits
    atexit.register(_exit_without_teardown, 130)
    raise
  if not joined:
    atexit.register(_exit_without_teardown, 2)
    raise errors.ConfigError(
      f'{me}: not every process joined `coordinator_address={address}` '
      f'within `coordinator_timeout={timeout_s:g}` s; start all '
      f'`num_processes={num_processes}` (process 0 first, reachable at that '
      'address) or wait longer'
    )
  if failed:
    raise failed[0]


def _exit_without_teardown(status: int) -> None:
  """Ends a process whose `join` gave up, at exit, with `status` (2: a
  failed start; 130: Ctrl-C) and at once: tearing down JAX's runtime while
  its join still waits in C++ takes 5 s more and logs the abandoned join
  in many lines."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)


def backend_started() -> bool:
  """Whether JAX has set up its devices (then `initialize` comes too late
  to change the host device count)."""
  try:
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):  # a JAX without the private helper
    return True


def initialize_for(devices, clients_per_round: int) -> None:
  """`initialize` with an ExperimentConfig's devices part (`config.devices`,
  with its processes) for K = `clients_per_round`.

  Idempotent; `mesh_for` (so `experiment.setup`) calls it, so a run
  started from Python gets the devices the command line gives it, if JAX
  has not set up its devices before (then `note_devices` says so).
  """
  initialize(
    host_devices=devices.host_devices,
    num_devices=devices.num_devices,
    clients_per_round=clients_per_round,
    coordinator_address=devices.processes.coordinator_address,
    num_processes=devices.processes.num_processes,
    process_id=devices.processes.process_id,
    coordinator_timeout=devices.processes.coordinator_timeout,
  )


def make_mesh(num_devices: int = 0) -> jax.sharding.Mesh:
  """A 1-D mesh over the first `num_devices` devices (0: all, globally).

  Raises:
    ArgumentError: naming `num_devices`, more than exist, or not 0 with
      several processes.
  """
  devices = jax.devices()
  if num_devices > len(devices):
    raise errors.ArgumentError(
      'num_devices',
      f'exceeds the {len(devices)} devices that exist ({devices[0].platform})',
    )
  if num_devices and jax.process_count() > 1 and num_devices != len(devices):
    raise errors.ArgumentError(
      'num_devices', 'must be 0 (all) when running several processes'
    )
  chosen = devices[: num_devices or len(devices)]
  return jax.sharding.Mesh(np.array(chosen), (AXIS,))


def mesh_for(devices, clients_per_round: int) -> jax.sharding.Mesh:
  """The mesh a run shards its K = `clients_per_round` clients over, from
  its config's devices part (`config.devices`).

  From Python as from the command line: if JAX has not set up its devices
  yet, the host devices (one per core, at most K) and processes of the
  config come first (`initialize_for`); else `note_devices` warns when
  there are fewer than the command line would give.

  Raises:
    ArgumentError: naming `clients_per_round` when it is fewer than the
      devices, or a field of `devices` as `make_mesh` and `initialize` do.
    ConfigError: as `join`.
  """
  if not backend_started():
    initialize_for(devices, clients_per_round)
  else:
    note_devices(devices, clients_per_round)
  mesh = make_mesh(devices.num_devices)
  num_devices = mesh.devices.size
  if num_devices > clients_per_round:
    raise errors.ArgumentError(
      'clients_per_round',
      f'is fewer than the {num_devices} devices the clients are sharded '
      'over; set `num_devices` (or `host_devices` on CPU) to at most '
      f'{clients_per_round}',
    )
  return mesh


def note_devices(devices, clients_per_round: int) -> None:
  """Warns when JAX set up fewer CPU devices than the command line would
  give a run of `devices` (a config's devices part) and K =
  `clients_per_round` (JAX started before `mesh_for` could choose)."""
  if jax.process_count() > 1 or jax.devices()[0].platform != 'cpu':
    return
  want = (
    devices.host_devices
    or devices.num_devices
    or auto_host_devices(clients_per_round)
  )
  have = len(jax.devices())
  if have < want and not devices.num_devices:
    warnings.warn(
      f'JAX started with {have} CPU device(s) before this run was set up; '
      f'the command line would use {want}. Call '
      'fedjax_mr.runtime.distributed.initialize_for(config.devices, K) before '
      'any '
      'JAX computation to get them.',
      stacklevel=4,  # the caller of `experiment.setup`
    )


def clients_per_device(clients_per_round: int, num_devices: int) -> int:
  """The clients each device trains in a round (the last may have empty
  ones)."""
  return -(-clients_per_round // num_devices)


# The most clients a GPU/TPU vmaps at once when `client_chunk` is 0. On an
# H200 (BUILD.md, "Scale"), cnn_mnist at K = 10,000 ran 5 % slower in chunks
# of 1,000 than all at once, in 1.2 GB of device memory instead of 11 GB, and
# resnet20 ran at K = 1,000's speed per client where 10,000 at once had not
# compiled after 120 s. Summing algorithms hold one chunk of trained models.
ACCELERATOR_CHUNK = 1000


# On CPU a model of at most TINY_MODEL_PARAMS parameters trains its clients
# in vmapped chunks of TINY_MODEL_CHUNK: each client's own fixed work (its
# epoch permutations, loop and optimizer set-up, a generated client's
# parameter draw) is a few small kernels, launched once a chunk instead of
# once a client. Synthetic(1, 1)'s 610-parameter logistic regression at
# K = 10^4 (BUILD.md, "Scale"): a round close to its limit, against a third
# above it one client at a time. Larger models keep 1 (vmap turns a
# convolution into a slower grouped one on XLA:CPU), so do their results;
# Fashion-MNIST's logistic regression has 7,850 parameters.
TINY_MODEL_PARAMS = 1000
TINY_MODEL_CHUNK = 8


def default_chunk(
  platform: str, clients_per_device: int, num_params: int | None = None
) -> int:
  """The clients a device trains at a time when `client_chunk` is 0: on
  CPU one after another, or `TINY_MODEL_CHUNK` for a model of
  `num_params` ≤ `TINY_MODEL_PARAMS` (None: not known, 1); elsewhere all
  of them up to `ACCELERATOR_CHUNK`."""
  if platform == 'cpu':
    tiny = num_params is not None and num_params <= TINY_MODEL_PARAMS
    return max(1, min(clients_per_device, TINY_MODEL_CHUNK)) if tiny else 1
  return max(1, min(clients_per_device, ACCELERATOR_CHUNK))


def client_mapping(
  clients_per_round: int,
  client_chunk: int,
  mesh: jax.sharding.Mesh,
  num_params: int | None = None,
) -> dict[str, Any]:
  """How a round's clients are mapped onto the devices of `mesh`:
  platform, processes, devices, and `client_chunk` (the clients a device
  trains at a time; 0 picks `default_chunk` for a model of `num_params`
  parameters).

  The mapping decides the order of the floating-point sums over clients,
  so each checkpoint keeps it.
  """
  num_devices = mesh.devices.size
  platform = mesh.devices.flat[0].platform
  per_device = clients_per_device(clients_per_round, num_devices)
  chunk = client_chunk or default_chunk(platform, per_device, num_params)
  return {
    'platform': platform,
    'processes': jax.process_count(),
    'devices': int(num_devices),
    'client_chunk': int(chunk),
  }


def describe_mapping(mapping: Mapping[str, Any]) -> str:
  """A `client_mapping` in words."""
  return (
    f'{mapping.get("devices")} {mapping.get("platform")} device(s) in '
    f'{mapping.get("processes")} process(es), `client_chunk='
    f'{mapping.get("client_chunk")}`'
  )


# Measured with jaxlib 0.10.2 (BUILD.md, "Reproducibility"): with the
# convolution gradient, several XLA host devices running at once on several
# cores give results that differ from run to run in the last digits (one
# device, one core, or the default im2col gradient do not).
CPU_DEVICES_NOTE = (
  'note: with the convolution gradient (layers.conv_implementation'
  "('conv')) XLA:CPU does not give bit-identical results from run to run "
  'with several host devices on several cores (differences start in the '
  'last digits and grow with the rounds); the default im2col gradient, or '
  '`host_devices=1` `num_devices=1`, is bit-reproducible'
)


# XLA's GPU backend may sum with atomics (scatter-adds, some reductions)
# and pick convolution algorithms that do, unless told not to.
GPU_NOTE = (
  'note: XLA on GPU is bit-reproducible only with '
  'XLA_FLAGS=--xla_gpu_deterministic_ops=true (slower); without it results '
  'may differ from run to run in the last digits'
)


def reproducibility_note(platform: str, num_devices: int) -> str | None:
  """The one-line note for a run traced now whose backend cannot promise
  bit-identical results from run to run, else None."""
  if platform == 'cpu' and num_devices > 1:
    if layers.conv_gradient() == 'conv':
      return CPU_DEVICES_NOTE
  if platform == 'gpu':
    flags = os.environ.get('XLA_FLAGS', '').split()
    if '--xla_gpu_deterministic_ops=true' not in flags:
      return GPU_NOTE
  return None


def replicated(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def replicate(tree, mesh: jax.sharding.Mesh):
  """Places every leaf of `tree` whole on every device of `mesh`.

  Every process must pass the same values (they are host data or results
  of the same deterministic computation). With several processes, they
  first wait for each other (`barrier`): the device_put checks the values
  across processes, and the CPU (gloo) collectives give up when one process
  reaches them more than 30 s after another, as a host that loads its data
  more slowly would.
  """
  barrier('fedjax_mr_replicate')
  return jax.device_put(tree, replicated(mesh))


BARRIER_TIMEOUT_S = 1800


def barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
  """Waits until every process reaches `barrier(name)`; no-op alone.

  Uses the distributed runtime's key-value service, not a collective, so
  its timeout is ours (collectives' own set-up timeout is fixed).
  """
  if jax.process_count() == 1:
    return
  from jax._src import distributed as jax_distributed  # no public API

  client = jax_distributed.global_state.client
  if client is None:
    return
  _barrier_counts[name] = _barrier_counts.get(name, 0) + 1
  client.wait_at_barrier(
    f'{name}/{_barrier_counts[name]}', int(timeout_s * 1000)
  )


_barrier_counts: dict[str, int] = {}


def is_primary() -> bool:
  """True in the process that writes files and logs (process 0)."""
  return jax.process_index() == 0
