"""The run pipeline, the layer under the programs: `registry` (the
algorithms the programs know), `config` (`ExperimentConfig` and its
validation), `experiment` (`setup`, `run` = the host loop,
`train_and_evaluate`, `load_run`) and the pieces of a run it calls: `build`
(dataset, partition, algorithm, pretrained variables from the config),
`evaluation`, `records` (the workdir's files and each round's rows),
`progress` (what a run logs), `resume` (restoring, interrupts) and
`energy_report`; and FedStitch's runs, through the same pieces:
`stitch_config` (`StitchConfig`) and `stitch_experiment` (its clients'
energy coordinators from `energy_report`).
"""

from fedjax_mr.pipeline import build as build
from fedjax_mr.pipeline import config as config
from fedjax_mr.pipeline import energy_report as energy_report
from fedjax_mr.pipeline import evaluation as evaluation
from fedjax_mr.pipeline import experiment as experiment
from fedjax_mr.pipeline import progress as progress
from fedjax_mr.pipeline import records as records
from fedjax_mr.pipeline import registry as registry
from fedjax_mr.pipeline import resume as resume
from fedjax_mr.pipeline import stitch_config as stitch_config
from fedjax_mr.pipeline import stitch_experiment as stitch_experiment
from fedjax_mr.pipeline.build import Experiment as Experiment
from fedjax_mr.pipeline.config import ExperimentConfig as ExperimentConfig
from fedjax_mr.pipeline.experiment import FinishedRun as FinishedRun
from fedjax_mr.pipeline.experiment import load_run as load_run
from fedjax_mr.pipeline.experiment import run as run
from fedjax_mr.pipeline.experiment import setup as setup
from fedjax_mr.pipeline.experiment import (
  train_and_evaluate as train_and_evaluate,
)
