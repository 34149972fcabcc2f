"""Host-side Jetson energy tools: DVFS, power, energy, coordinator, simulation.

Pure Python and numpy; this package never imports jax. Every file access goes
through a `SysfsRoot`, which tests point at a fake tree.

Modules: `sysfs` (file access), `discovery` (what the board has), `dvfs`
(what the DVFS backends share: errors, saved state, restoring on exit),
`sysfs_dvfs` and `nvpmodel` (the backends: setting clocks through sysfs,
switching nvpmodel modes), `power` and `energy_meter` (measuring),
`tegrastats` (log parser), `profiles` (device profiles, TX2 Table II),
`coordinator` (FedStitch §IV-D), `fleet` (the clients' coordinators in a
run's round loop, on simulated devices or through sysfs), `simulation`
(coordinator vs default governor) and `profiling` (measuring a profile on a
device).
"""

from fedjax_mr.energy import coordinator as coordinator
from fedjax_mr.energy import discovery as discovery
from fedjax_mr.energy import dvfs as dvfs
from fedjax_mr.energy import energy_meter as energy_meter
from fedjax_mr.energy import fleet as fleet
from fedjax_mr.energy import nvpmodel as nvpmodel
from fedjax_mr.energy import power as power
from fedjax_mr.energy import profiles as profiles
from fedjax_mr.energy import profiling as profiling
from fedjax_mr.energy import simulation as simulation
from fedjax_mr.energy import sysfs as sysfs
from fedjax_mr.energy import sysfs_dvfs as sysfs_dvfs
from fedjax_mr.energy import tegrastats as tegrastats
from fedjax_mr.energy.coordinator import Choice as Choice
from fedjax_mr.energy.coordinator import choose_config as choose_config
from fedjax_mr.energy.coordinator import cycle_time_s as cycle_time_s
from fedjax_mr.energy.coordinator import deadline_factors as deadline_factors
from fedjax_mr.energy.coordinator import predict_energies as predict_energies
from fedjax_mr.energy.coordinator import predict_times as predict_times
from fedjax_mr.energy.coordinator import reference_time_s as reference_time_s
from fedjax_mr.energy.coordinator import server_deadline as server_deadline
from fedjax_mr.energy.coordinator import update_time_scale as update_time_scale
from fedjax_mr.energy.discovery import DeviceInfo as DeviceInfo
from fedjax_mr.energy.discovery import describe as describe
from fedjax_mr.energy.discovery import discover as discover
from fedjax_mr.energy.dvfs import ApplyResult as ApplyResult
from fedjax_mr.energy.dvfs import DvfsError as DvfsError
from fedjax_mr.energy.dvfs import DvfsPermissionError as DvfsPermissionError
from fedjax_mr.energy.dvfs import DvfsState as DvfsState
from fedjax_mr.energy.dvfs import read_clocks as read_clocks
from fedjax_mr.energy.dvfs import snap as snap
from fedjax_mr.energy.energy_meter import EnergyMeter as EnergyMeter
from fedjax_mr.energy.energy_meter import EnergyReading as EnergyReading
from fedjax_mr.energy.energy_meter import trapezoid_energy as trapezoid_energy
from fedjax_mr.energy.fleet import Fleet as Fleet
from fedjax_mr.energy.fleet import SimulatedBackend as SimulatedBackend
from fedjax_mr.energy.fleet import SysfsBackend as SysfsBackend
from fedjax_mr.energy.nvpmodel import NvpmodelDvfs as NvpmodelDvfs
from fedjax_mr.energy.power import SysfsPowerMeter as SysfsPowerMeter
from fedjax_mr.energy.power import total_power_mw as total_power_mw
from fedjax_mr.energy.profiles import BUILTIN_PROFILES as BUILTIN_PROFILES
from fedjax_mr.energy.profiles import TX2_NVPMODEL_MODES as TX2_NVPMODEL_MODES
from fedjax_mr.energy.profiles import TX2_TABLE2_CHAINED as TX2_TABLE2_CHAINED
from fedjax_mr.energy.profiles import TX2_TABLE2_LITERAL as TX2_TABLE2_LITERAL
from fedjax_mr.energy.profiles import DeviceProfile as DeviceProfile
from fedjax_mr.energy.profiles import DvfsConfig as DvfsConfig
from fedjax_mr.energy.profiles import get_profile as get_profile
from fedjax_mr.energy.profiles import load_profile as load_profile
from fedjax_mr.energy.profiles import save_profile as save_profile
from fedjax_mr.energy.profiling import measure_profile as measure_profile
from fedjax_mr.energy.profiling import sweep_configs as sweep_configs
from fedjax_mr.energy.simulation import SimClient as SimClient
from fedjax_mr.energy.simulation import SimulationReport as SimulationReport
from fedjax_mr.energy.simulation import assign_profiles as assign_profiles
from fedjax_mr.energy.simulation import sample_rounds as sample_rounds
from fedjax_mr.energy.simulation import simulate as simulate
from fedjax_mr.energy.sysfs import EnergyError as EnergyError
from fedjax_mr.energy.sysfs import SysfsRoot as SysfsRoot
from fedjax_mr.energy.sysfs_dvfs import SysfsDvfs as SysfsDvfs
