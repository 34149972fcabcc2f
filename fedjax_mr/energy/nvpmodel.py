"""DVFS through nvpmodel: `NvpmodelDvfs` switches power modes (`nvpmodel
-m <id>`) through an injectable command runner and puts the mode back on
exit (`dvfs`).
"""

import logging
import subprocess
from typing import Callable
from typing import NamedTuple
from typing import Sequence

from fedjax_mr.energy import discovery
from fedjax_mr.energy import dvfs
from fedjax_mr.energy import profiles
from fedjax_mr.energy import sysfs

logger = logging.getLogger(__name__)


class CommandResult(NamedTuple):
  returncode: int
  output: str  # stdout and stderr together


Runner = Callable[[Sequence[str]], CommandResult]


def run_command(args: Sequence[str]) -> CommandResult:
  """Runs a command with no input (so nvpmodel never confirms a reboot)."""
  try:
    done = subprocess.run(
      list(args),
      stdin=subprocess.DEVNULL,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      timeout=60,
      check=False,
    )
  except FileNotFoundError as e:
    raise dvfs.DvfsError(f'{args[0]} not found: is this a Jetson?') from e
  return CommandResult(done.returncode, done.stdout)


def parse_nvpmodel_query(output: str) -> int:
  """The mode id in `nvpmodel -q` output ('NV Power Mode: MAXN' then '0')."""
  for line in reversed(output.strip().splitlines()):
    if line.strip().isdigit():
      return int(line.strip())
  raise dvfs.DvfsError(f'cannot read the mode from nvpmodel -q: {output!r}')


class NvpmodelDvfs(dvfs.RestoringSession):
  """Switches nvpmodel modes (`nvpmodel -m <id>`) for configs with an id.

  A mode sets caps, not fixed clocks: the governors keep choosing clocks
  below them. With a `root`, `apply` reads the clocks back for information.
  """

  def __init__(
    self,
    runner: Runner = run_command,
    *,
    root: sysfs.SysfsRoot | None = None,
    info: discovery.DeviceInfo | None = None,
    binary: str = 'nvpmodel',
    dry_run: bool = False,
    handle_signals: bool = True,
  ):
    super().__init__(dry_run, handle_signals)
    self.runner = runner
    self.root = root
    self.info = info
    if root is not None and info is None:
      self.info = discovery.discover(root)
    self.binary = binary
    self.commands: list[tuple[str, ...]] = []

  def _run(self, *args: str) -> CommandResult:
    command = (self.binary, *args)
    self.commands.append(command)
    result = self.runner(command)
    if result.returncode != 0:
      text = result.output.strip()
      last = text.splitlines()[-1] if text else 'no output'
      if 'permission' in text.lower() or 'root' in text.lower():
        raise dvfs.DvfsPermissionError(
          f'{" ".join(command)} is not permitted ({last}): run with sudo'
        )
      raise dvfs.DvfsError(
        f'{" ".join(command)} failed with code {result.returncode}: {last}'
      )
    return result

  def query(self) -> int:
    """The current mode id."""
    return parse_nvpmodel_query(self._run('-q').output)

  def snapshot(self) -> dvfs.DvfsState:
    return dvfs.DvfsState(
      cpu={}, online={}, gpu=None, emc=None, nvpmodel_id=self.query()
    )

  def _set_mode(self, mode: int) -> None:
    if self.dry_run:
      self.commands.append((self.binary, '-m', str(mode)))
      return
    self._run('-m', str(mode))
    now = self.query()
    if now != mode:
      raise dvfs.DvfsError(
        f'nvpmodel reports mode {now} after -m {mode} (does the mode need a'
        ' reboot?)'
      )

  def _restore(self, state: dvfs.DvfsState) -> None:
    if state.nvpmodel_id is not None and self.query() != state.nvpmodel_id:
      self._set_mode(state.nvpmodel_id)
    logger.info('nvpmodel mode %s restored', state.nvpmodel_id)

  def apply(self, config: profiles.DvfsConfig) -> dvfs.ApplyResult:
    """Switches to `config.nvpmodel_id`; saves the current mode first."""
    if config.nvpmodel_id is None:
      raise dvfs.DvfsError(f'{config.name} is not an nvpmodel mode (no id)')
    self._ensure_snapshot()
    self._set_mode(config.nvpmodel_id)
    if self.dry_run or self.root is None:
      return dvfs.ApplyResult(config, config)
    now = dvfs.read_clocks(self.root, self.info, config.name)
    effective = profiles.DvfsConfig(
      config.name,
      now.cpu_khz,
      gpu_hz=now.gpu_hz,
      emc_hz=now.emc_hz,
      online_cpus=now.online_cpus,
      nvpmodel_id=config.nvpmodel_id,
    )
    return dvfs.ApplyResult(config, effective)
