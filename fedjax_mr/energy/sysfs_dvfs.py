"""DVFS through sysfs: `SysfsDvfs` writes cpufreq and devfreq files (and,
if allowed, the EMC clock) directly, in a safe order, and reads the clocks
back; the state before the first change is restored on exit (`dvfs`).

    with SysfsDvfs(SysfsRoot('/')) as backend:
      result = backend.apply(config)   # result.effective: the clocks read back
"""

import errno
import logging
import time

from fedjax_mr.energy import discovery
from fedjax_mr.energy import dvfs
from fedjax_mr.energy import profiles
from fedjax_mr.energy import sysfs

logger = logging.getLogger(__name__)

CPU_METHODS = ('limits', 'userspace')


class SysfsDvfs(dvfs.RestoringSession):
  """Sets CPU, GPU (and optionally EMC) clocks through sysfs.

  Rules:
  * every frequency is snapped to an entry of the policy's or the GPU's table
    (`snap_rule`), and exact table values are written;
  * limits are written in a safe order: when the new minimum is above the
    current maximum, the maximum first, otherwise the minimum first, so the
    kernel never sees min > max;
  * CPU method 'limits' pins min = max (as nvpmodel and jetson_clocks do);
    'userspace' selects the userspace governor and writes `scaling_setspeed`,
    which the kernel clamps to the current limits (an nvpmodel cap stays);
  * the GPU is pinned with min = max on its devfreq node;
  * cores are brought online before, and taken offline after, clock writes;
  * the clocks are read back; a difference is logged as a warning
    (throttling or a cap) and returned in `dvfs.ApplyResult.mismatches`;
  * in dry-run mode, nothing is written: `writes` lists what would be.
  """

  def __init__(
    self,
    root: sysfs.SysfsRoot,
    info: discovery.DeviceInfo | None = None,
    *,
    snap_rule: str = 'floor',
    cpu_method: str = 'limits',
    gpu_governor: str | None = None,
    allow_emc: bool = False,
    dry_run: bool = False,
    settle_s: float = 0.1,
    handle_signals: bool = True,
  ):
    """Builds the backend; nothing changes until `apply`.

    Args:
      root: sysfs root ('/' on a device).
      info: discovery result; discovered from `root` when None.
      snap_rule: 'floor', 'ceil' or 'nearest' (see `snap`).
      cpu_method: 'limits' or 'userspace'.
      gpu_governor: a devfreq governor to select before pinning the GPU, or
        None to keep the current one.
      allow_emc: write the EMC clock of configs that have one (debugfs, root);
        by default the EMC is only read.
      dry_run: record the writes in `writes` without making them.
      settle_s: seconds to wait before reading the clocks back.
      handle_signals: turn SIGINT/SIGTERM into exceptions while the context
        is open (main thread only), so the state is restored.
    """
    super().__init__(dry_run, handle_signals)
    if snap_rule not in dvfs.SNAP_RULES:
      raise ValueError(
        f'snap_rule must be one of {dvfs.SNAP_RULES}: {snap_rule!r}'
      )
    if cpu_method not in CPU_METHODS:
      raise ValueError(
        f'cpu_method must be one of {CPU_METHODS}: {cpu_method!r}'
      )
    self.root = root
    self.info = info if info is not None else discovery.discover(root)
    self.snap_rule = snap_rule
    self.cpu_method = cpu_method
    self.gpu_governor = gpu_governor
    self.allow_emc = allow_emc
    self.settle_s = settle_s
    self.writes: list[tuple[str, str]] = []
    self._shadow: dict[str, str] = {}

  # File access: in dry-run mode, reads see the planned writes.

  def _read(self, rel: str) -> str:
    if rel in self._shadow:
      return self._shadow[rel]
    return self.root.read(rel)

  def _read_int(self, rel: str) -> int:
    return int(self._read(rel))

  def _write(self, rel: str, value: int | str) -> None:
    value = str(value)
    self.writes.append((rel, value))
    if self.dry_run:
      self._shadow[rel] = value
      return
    try:
      self.root.write(rel, value)
    except PermissionError as e:
      raise dvfs.DvfsPermissionError(
        f'not permitted to write {value} to {self.root.path(rel)}: changing'
        ' clocks needs root (run with sudo), or use a dry run to list the'
        ' writes'
      ) from e
    except OSError as e:
      reason = errno.errorcode.get(e.errno, e.strerror or str(e))
      raise dvfs.DvfsError(
        f'the kernel rejected {value} for {self.root.path(rel)} ({reason})'
      ) from e

  def _write_if_changed(self, rel: str, value: int | str) -> None:
    if self._read(rel) != str(value):
      self._write(rel, value)

  def _set_limits(self, min_rel: str, max_rel: str, lo: int, hi: int) -> None:
    """Writes [lo, hi] so that min <= max holds after every single write."""
    if lo > self._read_int(max_rel):  # Raising: make room above first.
      order = ((max_rel, hi), (min_rel, lo))
    else:  # Lowering (or inside the range): min first.
      order = ((min_rel, lo), (max_rel, hi))
    for rel, value in order:
      self._write_if_changed(rel, value)

  # State.

  def snapshot(self) -> dvfs.DvfsState:
    """Governors, limits, setspeed, online cores, GPU and (if allowed) EMC."""
    cpu = {}
    for p in self.info.cpu_policies:
      governor = self.root.try_read(sysfs.join(p.path, 'scaling_governor'))
      if governor is None:  # Inactive policy (all cores offline): unreadable.
        continue
      setspeed = self.root.try_read(sysfs.join(p.path, 'scaling_setspeed'))
      cpu[p.name] = dvfs.CpuPolicyState(
        governor=governor,
        min_khz=self.root.read_int(sysfs.join(p.path, 'scaling_min_freq')),
        max_khz=self.root.read_int(sysfs.join(p.path, 'scaling_max_freq')),
        setspeed_khz=int(setspeed) if setspeed and setspeed.isdigit() else None,
      )
    online = {}
    for c in self.info.cpus:
      text = self.root.try_read(discovery.online_path(c))
      if text is not None:
        online[c] = text == '1'
    gpu = None
    if self.info.gpu is not None:
      path = self.info.gpu.path
      gpu = dvfs.DevfreqState(
        governor=self.root.read(sysfs.join(path, 'governor')),
        min_hz=self.root.read_int(sysfs.join(path, 'min_freq')),
        max_hz=self.root.read_int(sysfs.join(path, 'max_freq')),
      )
    emc = None
    if self.allow_emc and self.info.emc is not None:
      lock = self.info.emc.lock_path
      emc = dvfs.EmcState(
        rate_hz=self.root.read_int(self.info.emc.rate_path),
        lock=self.root.read(lock) if lock else None,
      )
    return dvfs.DvfsState(cpu=cpu, online=online, gpu=gpu, emc=emc)

  def _restore(self, state: dvfs.DvfsState) -> None:
    """Restores `state`, trying every item; raises once at the end."""
    failures = []

    def attempt(fn, *args):
      try:
        fn(*args)
      except dvfs.DvfsError as e:
        failures.append(e)

    for c, was_online in state.online.items():
      if was_online:
        attempt(self._write_if_changed, discovery.online_path(c), 1)
    if any(state.online.values()):
      self._refresh_policies()
    for name, s in state.cpu.items():
      path = self.info.policy(name).path
      attempt(
        self._set_limits,
        sysfs.join(path, 'scaling_min_freq'),
        sysfs.join(path, 'scaling_max_freq'),
        s.min_khz,
        s.max_khz,
      )
      attempt(
        self._write_if_changed, sysfs.join(path, 'scaling_governor'), s.governor
      )
      if s.governor == 'userspace' and s.setspeed_khz is not None:
        attempt(
          self._write_if_changed,
          sysfs.join(path, 'scaling_setspeed'),
          s.setspeed_khz,
        )
    if state.gpu is not None and self.info.gpu is not None:
      path = self.info.gpu.path
      attempt(
        self._set_limits,
        sysfs.join(path, 'min_freq'),
        sysfs.join(path, 'max_freq'),
        state.gpu.min_hz,
        state.gpu.max_hz,
      )
      attempt(
        self._write_if_changed,
        sysfs.join(path, 'governor'),
        state.gpu.governor,
      )
    if state.emc is not None and self.info.emc is not None:
      attempt(
        self._write_if_changed, self.info.emc.rate_path, state.emc.rate_hz
      )
      if state.emc.lock is not None and self.info.emc.lock_path:
        attempt(self._write_if_changed, self.info.emc.lock_path, state.emc.lock)
    for c, was_online in state.online.items():
      if not was_online:
        attempt(self._write_if_changed, discovery.online_path(c), 0)
    if failures:
      message = 'could not restore the DVFS state: ' + '; '.join(
        str(e) for e in failures
      )
      if any(isinstance(e, PermissionError) for e in failures):
        raise dvfs.DvfsPermissionError(message)
      raise dvfs.DvfsError(message)
    logger.info('DVFS state restored')

  def _refresh_policies(self) -> None:
    """Re-reads the policies: ones that were offline become readable."""
    if not self.dry_run:
      self.info = self.info._replace(
        cpu_policies=discovery.find_cpu_policies(self.root)
      )

  # Applying a configuration.

  def _plan_online(self, config: profiles.DvfsConfig):
    """Cores to bring online and to take offline for `config`."""
    if config.online_cpus is None:
      return (), ()
    wanted = set(config.online_cpus)
    unknown = wanted - set(self.info.cpus)
    if unknown:
      raise dvfs.DvfsError(f'{config.name}: no such cores: {sorted(unknown)}')
    up, down = [], []
    for c in self.info.cpus:
      rel = discovery.online_path(c)
      if not self.root.exists(rel):  # No hotplug file (cpu0): always online.
        if c not in wanted:
          raise dvfs.DvfsError(f'{config.name}: cpu{c} cannot go offline')
        continue
      state = self._read(rel)
      if c in wanted and state != '1':
        up.append(c)
      elif c not in wanted and state != '0':
        down.append(c)
    return tuple(up), tuple(down)

  def _online_now(self) -> set[int]:
    return {
      c
      for c in self.info.cpus
      if not self.root.exists(discovery.online_path(c))
      or self._read(discovery.online_path(c)) == '1'
    }

  def _cpu_requests(self, config: profiles.DvfsConfig) -> dict[str, int]:
    """Requested kHz per policy with an online core under `config`."""
    online = (
      self._online_now()
      if config.online_cpus is None
      else set(config.online_cpus)
    )
    requests = {}
    named = set(config.cpu_khz) - {'*'}
    for key, khz in config.cpu_khz.items():
      if key == '*':
        policies = [p for p in self.info.cpu_policies if p.name not in named]
      else:
        try:
          policies = [self.info.policy(key)]
        except KeyError as e:
          raise dvfs.DvfsError(f'{config.name}: {e.args[0]}') from None
      for p in policies:
        if online & set(p.cpus):
          requests[p.name] = khz
        elif key != '*':
          raise dvfs.DvfsError(
            f'{config.name}: sets {p.name} but all its cores are offline'
            ' (list them in online_cpus)'
          )
    return requests

  def _snap_cpu(self, name: str, khz: int) -> int:
    p = self.info.policy(name)
    if p.frequencies_khz:
      return dvfs.snap(khz, p.frequencies_khz, self.snap_rule)
    return min(max(khz, p.min_khz), p.max_khz or khz)  # No table: clamp.

  def _set_cpu(self, policy: discovery.CpuPolicy, khz: int) -> None:
    path = policy.path
    if self.cpu_method == 'limits':
      self._set_limits(
        sysfs.join(path, 'scaling_min_freq'),
        sysfs.join(path, 'scaling_max_freq'),
        khz,
        khz,
      )
      return
    if 'userspace' not in policy.governors:
      raise dvfs.DvfsError(
        f'{policy.name}: no userspace governor (has:'
        f' {" ".join(policy.governors)}); use the limits method'
      )
    self._write_if_changed(sysfs.join(path, 'scaling_governor'), 'userspace')
    self._write(sysfs.join(path, 'scaling_setspeed'), khz)

  def apply(self, config: profiles.DvfsConfig) -> dvfs.ApplyResult:
    """Sets `config`; saves the state first if nothing was changed yet.

    Args:
      config: the configuration; clocks are snapped to the tables.

    Returns:
      The snapped request, the clocks read back and any mismatches.

    Raises:
      dvfs.DvfsPermissionError: a file may not be written (not root).
      dvfs.DvfsError: the configuration does not fit the device, or the kernel
        rejected a value.
    """
    self._ensure_snapshot()
    up, down = self._plan_online(config)
    cpu_requests = self._cpu_requests(config)
    gpu_target = None
    if config.gpu_hz is not None:
      if self.info.gpu is None:
        raise dvfs.DvfsError(f'{config.name}: sets the GPU but none was found')
      gpu_target = dvfs.snap(
        config.gpu_hz, self.info.gpu.frequencies_hz, self.snap_rule
      )
    emc_target = None
    if config.emc_hz is not None and self.allow_emc:
      if self.info.emc is None:
        raise dvfs.DvfsError(
          f'{config.name}: sets the EMC but it is not readable'
        )
      emc_target = config.emc_hz

    for c in up:
      self._write(discovery.online_path(c), 1)
    if up:
      self._refresh_policies()  # Onlined policies can now be read.
    cpu_targets = {
      name: self._snap_cpu(name, khz) for name, khz in cpu_requests.items()
    }
    for name, khz in cpu_targets.items():
      self._set_cpu(self.info.policy(name), khz)
    if gpu_target is not None:
      path = self.info.gpu.path
      if self.gpu_governor is not None:
        self._write_if_changed(sysfs.join(path, 'governor'), self.gpu_governor)
      self._set_limits(
        sysfs.join(path, 'min_freq'),
        sysfs.join(path, 'max_freq'),
        gpu_target,
        gpu_target,
      )
    if emc_target is not None:
      if self.info.emc.lock_path:
        self._write_if_changed(self.info.emc.lock_path, 1)
      self._write(self.info.emc.rate_path, emc_target)
    for c in down:
      self._write(discovery.online_path(c), 0)

    requested = profiles.DvfsConfig(
      config.name,
      cpu_targets,
      gpu_hz=gpu_target,
      emc_hz=emc_target,
      online_cpus=config.online_cpus,
      nvpmodel_id=config.nvpmodel_id,
    )
    if self.dry_run:
      return dvfs.ApplyResult(requested, requested)
    if self.settle_s > 0:
      time.sleep(self.settle_s)
    effective = self.read_effective(requested)
    mismatches = dvfs.mismatches(requested, effective)
    if mismatches:
      logger.warning(
        'Clocks differ from the request (thermal throttling or a power-mode'
        ' cap?): %s',
        '; '.join(mismatches),
      )
    return dvfs.ApplyResult(requested, effective, mismatches)

  def read_effective(
    self, requested: profiles.DvfsConfig
  ) -> profiles.DvfsConfig:
    """The clocks now running for the domains that `requested` sets."""
    now = dvfs.read_clocks(
      self.root, self.info, requested.name, policies=list(requested.cpu_khz)
    )
    return profiles.DvfsConfig(
      requested.name,
      now.cpu_khz,
      gpu_hz=now.gpu_hz if requested.gpu_hz is not None else None,
      emc_hz=now.emc_hz if requested.emc_hz is not None else None,
      online_cpus=now.online_cpus,
      nvpmodel_id=requested.nvpmodel_id,
    )
