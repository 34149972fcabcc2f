"""Benchmarks of a federated round against the hardware limit: a
`Setting` in, `measure(setting) -> Report` out (`measure`'s docstring
says what is timed and how)."""

from fedjax_mr.bench.measure import NO_TORCH_LINE
from fedjax_mr.bench.measure import TorchLoop
from fedjax_mr.bench.measure import TorchLoopFactory
from fedjax_mr.bench.measure import check
from fedjax_mr.bench.measure import measure
from fedjax_mr.bench.report import Figures
from fedjax_mr.bench.report import Report
from fedjax_mr.bench.runs import dataset_fields
from fedjax_mr.bench.setting import Setting
from fedjax_mr.bench.setting import choices
from fedjax_mr.bench.setting import flag_fields
from fedjax_mr.bench.setting import synthetic

__all__ = [
  'NO_TORCH_LINE',
  'Figures',
  'Report',
  'Setting',
  'TorchLoop',
  'TorchLoopFactory',
  'check',
  'choices',
  'dataset_fields',
  'flag_fields',
  'measure',
  'synthetic',
]
