"""Parser for `tegrastats` lines (TX2 / L4T 32 and Orin / JetPack 5-6 formats).

TX2:  ... CPU [0%@350,off,...] EMC_FREQ 17%@40 GR3D_FREQ 0%@114 ...
      GPU@32C ... VDD_IN 1876/1876 VDD_SYS_CPU 229/229 ...
Orin: ... GR3D_FREQ 10%@1300 (or 12%@[1300,1300] per GPC) ...
      VDD_IN 5032mW/5032mW (or three values: 5139mW/5139mW/5139mW)
"""

import re
from typing import NamedTuple

from fedjax_mr.energy import power

_RAM = re.compile(r'\bRAM (\d+)/(\d+)MB')
_SWAP = re.compile(r'\bSWAP (\d+)/(\d+)MB')
_CPU = re.compile(r'\bCPU \[([^\]]*)\]')
_CORE = re.compile(r'(\d+)%(?:@(\d+))?$')
_CLOCK = re.compile(r'\b(EMC_FREQ|GR3D_FREQ) (\d+)%(?:@(\[[\d,]*\]|\d+))?')
_TEMP = re.compile(r'\b(\w+)@(-?\d+(?:\.\d+)?)C\b')
_RAIL = re.compile(
  r'\b([A-Z][A-Z0-9_]*) (\d+)(?:mW)?/(\d+)(?:mW)?(?:/(\d+)(?:mW)?)?(?=\s|$)'
)


class CoreUse(NamedTuple):
  load_pct: int
  freq_mhz: int | None


class ClockUse(NamedTuple):
  """Utilisation and clock(s) of EMC or the GPU (one clock per GPC on Orin)."""

  load_pct: int
  freq_mhz: tuple[int, ...]


class TegraStats(NamedTuple):
  """One parsed tegrastats line; fields absent from the line are None/empty.

  Attributes:
    ram_mb: (used, total) MB.
    swap_mb: (used, total) MB.
    cpus: per core, a `CoreUse` or None when the core is off.
    emc: memory controller use.
    gpu: GR3D (GPU) use.
    temps_c: temperature per sensor, °C.
    rails_mw: per rail, (current, average[, peak]) mW; 'NC' rails skipped.
  """

  ram_mb: tuple[int, int] | None
  swap_mb: tuple[int, int] | None
  cpus: tuple[CoreUse | None, ...]
  emc: ClockUse | None
  gpu: ClockUse | None
  temps_c: dict[str, float]
  rails_mw: dict[str, tuple[int, ...]]

  def current_mw(self) -> dict[str, int]:
    """The current (first) value of every rail, in mW."""
    return {name: values[0] for name, values in self.rails_mw.items()}

  def total_mw(self) -> float:
    """Module power now: VDD_IN / POM_5V_IN, else the sum of rails."""
    return power.total_power_mw(self.current_mw())


def _pair(match: re.Match | None) -> tuple[int, int] | None:
  return (int(match.group(1)), int(match.group(2))) if match else None


def _cores(text: str) -> tuple[CoreUse | None, ...]:
  cores = []
  for item in text.split(','):
    item = item.strip()
    m = _CORE.match(item)
    if m is None:  # 'off'
      cores.append(None)
    else:
      freq = int(m.group(2)) if m.group(2) else None
      cores.append(CoreUse(int(m.group(1)), freq))
  return tuple(cores)


def _freqs(text: str | None) -> tuple[int, ...]:
  if not text:
    return ()
  return tuple(int(f) for f in text.strip('[]').split(',') if f)


def parse_line(line: str) -> TegraStats:
  """Parses one tegrastats line (either format)."""
  cpu = _CPU.search(line)
  clocks = {
    m.group(1): ClockUse(int(m.group(2)), _freqs(m.group(3)))
    for m in _CLOCK.finditer(line)
  }
  rails = {}
  for m in _RAIL.finditer(line):
    if m.group(1) == 'NC':
      continue
    rails[m.group(1)] = tuple(int(v) for v in m.groups()[1:] if v is not None)
  return TegraStats(
    ram_mb=_pair(_RAM.search(line)),
    swap_mb=_pair(_SWAP.search(line)),
    cpus=_cores(cpu.group(1)) if cpu else (),
    emc=clocks.get('EMC_FREQ'),
    gpu=clocks.get('GR3D_FREQ'),
    temps_c={m.group(1): float(m.group(2)) for m in _TEMP.finditer(line)},
    rails_mw=rails,
  )
