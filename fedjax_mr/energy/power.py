"""Power readings from the Jetson's INA3221 monitors, by rail label.

Channels are always identified by their label (`rail_name_N` or `inN_label`),
never by index: channel order differs between boards and kernels.
"""

from typing import Mapping
from typing import Sequence

from fedjax_mr.energy import discovery
from fedjax_mr.energy import sysfs

# Rails that measure the whole module input; the total when present.
TOTAL_RAILS = ('VDD_IN', 'POM_5V_IN')


def total_power_mw(rails_mw: Mapping[str, float]) -> float:
  """The module's total power: VDD_IN or POM_5V_IN if there, else the sum.

  Args:
    rails_mw: power per rail label, in mW.

  Returns:
    Total power in mW.
  """
  for name in TOTAL_RAILS:
    if name in rails_mw:
      return rails_mw[name]
  return float(sum(rails_mw.values()))


def read_channel_mw(
  root: sysfs.SysfsRoot, channel: discovery.PowerChannel
) -> float:
  """One channel's power in mW: the power file, else V (mV) · I (mA) / 1000."""
  if channel.power_path is not None:
    return float(root.read_int(channel.power_path))
  if channel.voltage_path is None or channel.current_path is None:
    raise sysfs.EnergyError(f'rail {channel.label} has no power reading')
  mv = root.read_int(channel.voltage_path)
  ma = root.read_int(channel.current_path)
  return mv * ma / 1000.0


class SysfsPowerMeter:
  """Reads every INA3221 rail of the device through sysfs."""

  def __init__(
    self,
    root: sysfs.SysfsRoot,
    channels: Sequence[discovery.PowerChannel] | None = None,
  ):
    """Builds the meter.

    Args:
      root: sysfs root.
      channels: the channels to read; discovered from `root` when None.

    Raises:
      EnergyError: no power monitor was found.
    """
    self.root = root
    if channels is None:
      channels = discovery.find_power_channels(root)
    if not channels:
      raise sysfs.EnergyError(
        f'no INA3221 power monitor found below {root.root} (is this a Jetson?)'
      )
    self.channels = tuple(channels)

  def rails(self) -> tuple[str, ...]:
    return tuple(ch.label for ch in self.channels)

  def read_mw(self) -> dict[str, float]:
    """Power per rail label, in mW."""
    return {ch.label: read_channel_mw(self.root, ch) for ch in self.channels}

  def total_mw(self) -> float:
    return total_power_mw(self.read_mw())

  def total_w(self) -> float:
    """Total power in W (the reader an `EnergyMeter` takes)."""
    return self.total_mw() / 1000.0
