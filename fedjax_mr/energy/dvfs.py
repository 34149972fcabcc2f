"""What the DVFS backends share: set a `DvfsConfig` on a Jetson and put
everything back.

The backends (`sysfs_dvfs.SysfsDvfs` writes cpufreq and devfreq files
directly; `nvpmodel.NvpmodelDvfs` switches nvpmodel modes through an
injectable command runner) are `RestoringSession`s, context managers: the
state is saved before the first change and restored on exit, also after an
exception, Ctrl-C (SIGINT) or SIGTERM. Here: their errors, the saved state,
the result of `apply`, frequency snapping and reading the clocks back.

    with sysfs_dvfs.SysfsDvfs(SysfsRoot('/')) as backend:
      result = backend.apply(config)  # result.effective: the clocks read back
      ...                           # run the workload
    # clocks, governors and online cores are back as they were
"""

import abc
import signal
import threading
from typing import Mapping
from typing import NamedTuple
from typing import Sequence

from fedjax_mr.energy import discovery
from fedjax_mr.energy import profiles
from fedjax_mr.energy import sysfs

SNAP_RULES = ('floor', 'ceil', 'nearest')


class DvfsError(sysfs.EnergyError):
  """A DVFS change could not be made."""


class DvfsPermissionError(DvfsError, PermissionError):
  """The process may not change clocks (not root)."""


def snap(value: int, table: Sequence[int], rule: str = 'floor') -> int:
  """The entry of a frequency table that `value` stands for.

  Args:
    value: requested frequency.
    table: available frequencies (any order); empty means any value goes.
    rule: 'floor' (highest entry <= value, else the lowest entry), 'ceil'
      (lowest entry >= value, else the highest) or 'nearest' (ties go down).

  Returns:
    A member of `table`, or `value` when the table is empty.
  """
  if rule not in SNAP_RULES:
    raise ValueError(f'snap rule must be one of {SNAP_RULES}, not {rule!r}')
  if not table:
    return value
  table = sorted(table)
  if rule == 'floor':
    below = [f for f in table if f <= value]
    return below[-1] if below else table[0]
  if rule == 'ceil':
    above = [f for f in table if f >= value]
    return above[0] if above else table[-1]
  return min(table, key=lambda f: (abs(f - value), f))


class CpuPolicyState(NamedTuple):
  governor: str
  min_khz: int
  max_khz: int
  setspeed_khz: int | None  # Only meaningful under the userspace governor.


class DevfreqState(NamedTuple):
  governor: str
  min_hz: int
  max_hz: int


class EmcState(NamedTuple):
  rate_hz: int
  lock: str | None


class DvfsState(NamedTuple):
  """What a backend saves before its first change, to restore it later."""

  cpu: Mapping[str, CpuPolicyState]
  online: Mapping[int, bool]
  gpu: DevfreqState | None
  emc: EmcState | None
  nvpmodel_id: int | None = None


class ApplyResult(NamedTuple):
  """What `apply` did.

  Attributes:
    requested: the configuration after snapping to the frequency tables.
    effective: the clocks read back after the change (equal to `requested` in
      dry-run mode).
    mismatches: one line per clock that runs below or above the request
      (thermal throttling, a power-mode cap); empty when all match.
  """

  requested: profiles.DvfsConfig
  effective: profiles.DvfsConfig
  mismatches: tuple[str, ...] = ()

  @property
  def throttled(self) -> bool:
    return bool(self.mismatches)


def read_clocks(
  root: sysfs.SysfsRoot,
  info: discovery.DeviceInfo,
  name: str = 'current',
  policies: Sequence[str] | None = None,
) -> profiles.DvfsConfig:
  """The clocks running now, as a `DvfsConfig`.

  Args:
    root: sysfs root.
    info: what `discover` found.
    name: name of the returned configuration.
    policies: the CPU policies to read; all by default. Policies whose cores
      are all offline cannot be read and are left out.

  Returns:
    The current CPU clock per policy (kHz), GPU and EMC clocks (Hz) and
    online cores.
  """
  wanted = None if policies is None else set(policies)
  cpu = {}
  for p in info.cpu_policies:
    if wanted is not None and p.name not in wanted:
      continue
    for f in ('scaling_cur_freq', 'cpuinfo_cur_freq'):
      text = root.try_read(sysfs.join(p.path, f))
      if text and text.isdigit():
        cpu[p.name] = int(text)
        break
  gpu = None
  if info.gpu is not None:
    text = root.try_read(sysfs.join(info.gpu.path, 'cur_freq'))
    gpu = int(text) if text and text.isdigit() else None
  emc = None
  if info.emc is not None:
    text = root.try_read(info.emc.rate_path)
    emc = int(text) if text and text.isdigit() else None
  online = tuple(
    c
    for c in info.cpus
    if root.try_read(discovery.online_path(c)) in (None, '1')
  )
  return profiles.DvfsConfig(
    name, cpu, gpu_hz=gpu, emc_hz=emc, online_cpus=online
  )


def _signal_exception(signum: int) -> BaseException:
  if signum == signal.SIGINT:
    return KeyboardInterrupt()
  return SystemExit(128 + signum)


class RestoringSession(abc.ABC):
  """Snapshot before the first change, restore on exit and on signals.

  Subclasses implement `snapshot()` and `_restore(state)` and call
  `_ensure_snapshot()` before changing anything.
  """

  def __init__(self, dry_run: bool, handle_signals: bool):
    self.dry_run = dry_run
    self._handle_signals = handle_signals
    self._saved = None
    self._old_handlers = {}
    self._restoring = False
    self._pending_signal = None

  @abc.abstractmethod
  def snapshot(self) -> DvfsState:
    """Reads the state that `restore` puts back."""

  @abc.abstractmethod
  def _restore(self, state: DvfsState) -> None:
    """Puts `state` back."""

  @property
  def saved_state(self) -> DvfsState | None:
    """The state saved before the first change, until it is restored."""
    return self._saved

  def _ensure_snapshot(self) -> None:
    if self._saved is None and not self.dry_run:
      self._saved = self.snapshot()

  def restore(self, state: DvfsState | None = None) -> None:
    """Restores `state`, by default the one saved before the first change."""
    if state is None:
      state, self._saved = self._saved, None
    if state is not None and not self.dry_run:
      self._restore(state)

  def _on_signal(self, signum, frame):
    del frame
    if self._restoring:  # Finish restoring first, then act on it.
      self._pending_signal = signum
      return
    raise _signal_exception(signum)

  def __enter__(self):
    if (
      self._handle_signals
      and threading.current_thread() is threading.main_thread()
    ):
      for sig in (signal.SIGINT, signal.SIGTERM):
        self._old_handlers[sig] = signal.signal(sig, self._on_signal)
    return self

  def __exit__(self, exc_type, exc, tb):
    self._restoring = True
    try:
      self.restore()
    finally:
      for sig, old in self._old_handlers.items():
        signal.signal(sig, signal.SIG_DFL if old is None else old)
      self._old_handlers = {}
      self._restoring = False
    if self._pending_signal is not None:
      signum, self._pending_signal = self._pending_signal, None
      raise _signal_exception(signum)
    return False


def mismatches(
  requested: profiles.DvfsConfig, effective: profiles.DvfsConfig
) -> tuple[str, ...]:
  """One line per clock of `requested` that `effective` does not run at."""
  out = []
  for name, khz in requested.cpu_khz.items():
    got = effective.cpu_khz.get(name)
    if got != khz:
      out.append(f'{name} asked {khz} kHz, runs {got} kHz')
  for field, unit in (('gpu_hz', 'gpu'), ('emc_hz', 'emc')):
    want, got = getattr(requested, field), getattr(effective, field)
    if want is not None and got != want:
      out.append(f'{unit} asked {want} Hz, runs {got} Hz')
  if requested.online_cpus is not None and set(requested.online_cpus) != set(
    effective.online_cpus or ()
  ):
    out.append(
      f'online cores asked {sorted(requested.online_cpus)},'
      f' are {sorted(effective.online_cpus or ())}'
    )
  return tuple(out)
