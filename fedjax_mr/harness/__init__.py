"""The experiment harness, the layer under the programs: the algorithm
registry, the experiment config, the host loop, comparison and figures.

Modules: `registry` (the algorithms the programs know: flags, variants,
labels), `config` (`ExperimentConfig`: the flags and their validation),
`experiment` (setup, the host loop, resume, evaluation, `load_run`),
`compare` (variants x seeds, tables), `checkpoint` (orbax, verified
restore), `metrics_io` (metrics.jsonl), `plots`, `tensorboard`,
`provenance`, `distributed` (devices, meshes, processes), `landscape`
(loss landscapes) and `stitch_figures` (FedStitch's tables and figures).
It imports every layer below it; nothing below imports it.
"""

from fedjax_mr.harness import checkpoint as checkpoint
from fedjax_mr.harness import compare as compare
from fedjax_mr.harness import config as config
from fedjax_mr.harness import distributed as distributed
from fedjax_mr.harness import experiment as experiment
from fedjax_mr.harness import landscape as landscape
from fedjax_mr.harness import metrics_io as metrics_io
from fedjax_mr.harness import plots as plots
from fedjax_mr.harness import provenance as provenance
from fedjax_mr.harness import registry as registry
from fedjax_mr.harness import stitch_figures as stitch_figures
from fedjax_mr.harness import tensorboard as tensorboard
from fedjax_mr.harness.config import ExperimentConfig as ExperimentConfig
from fedjax_mr.harness.experiment import FinishedRun as FinishedRun
from fedjax_mr.harness.experiment import load_run as load_run
from fedjax_mr.harness.experiment import setup as setup
from fedjax_mr.harness.experiment import (
  train_and_evaluate as train_and_evaluate,
)
