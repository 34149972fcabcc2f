"""The experiment harness, the layer under the programs: the algorithm
registry, the experiment config, the host loop, comparison and figures.

Modules: `registry` (the algorithms the programs know: flags, variants,
labels), `config` (`ExperimentConfig`: the flags and their validation),
`experiment` (`setup`, `run` = the host loop, `train_and_evaluate`,
`load_run`) and the pieces of a run it calls: `build` (`Experiment`;
dataset, partition, algorithm, pretrained variables from the config),
`evaluation` (global and K-model evaluation), `records` (the workdir's
files and each round's rows), `progress` (what a run logs), `resume`
(restoring, interrupts), `energy_report` (energy.json), `checkpoint`
(orbax, verified restore), `metrics_io` (metrics.jsonl), `tensorboard`,
`provenance`, `distributed` (devices, meshes, processes, the client
mapping); `compare` (variants x seeds, tables), `plots`, `landscape`
(loss landscapes) and `stitch_figures` (FedStitch's tables and figures).
It imports every layer below it; nothing below imports it.
"""

from fedjax_mr.harness import build as build
from fedjax_mr.harness import checkpoint as checkpoint
from fedjax_mr.harness import compare as compare
from fedjax_mr.harness import config as config
from fedjax_mr.harness import distributed as distributed
from fedjax_mr.harness import energy_report as energy_report
from fedjax_mr.harness import evaluation as evaluation
from fedjax_mr.harness import experiment as experiment
from fedjax_mr.harness import landscape as landscape
from fedjax_mr.harness import metrics_io as metrics_io
from fedjax_mr.harness import plots as plots
from fedjax_mr.harness import progress as progress
from fedjax_mr.harness import provenance as provenance
from fedjax_mr.harness import records as records
from fedjax_mr.harness import registry as registry
from fedjax_mr.harness import resume as resume
from fedjax_mr.harness import stitch_figures as stitch_figures
from fedjax_mr.harness import tensorboard as tensorboard
from fedjax_mr.harness.build import Experiment as Experiment
from fedjax_mr.harness.config import ExperimentConfig as ExperimentConfig
from fedjax_mr.harness.experiment import FinishedRun as FinishedRun
from fedjax_mr.harness.experiment import load_run as load_run
from fedjax_mr.harness.experiment import run as run
from fedjax_mr.harness.experiment import setup as setup
from fedjax_mr.harness.experiment import (
  train_and_evaluate as train_and_evaluate,
)
