"""What is read from finished runs, above the run pipeline (which never
imports it): `compare` (variants x seeds, tables and figures), `probe`
(what a trained or stitched model's features hold), `landscape` (loss
landscapes), `stitch_figures` (FedStitch's tables and figures) and
`stitch_paper` (one of them made: `make(Setting) -> Made`).
"""

from fedjax_mr.analysis import compare as compare
from fedjax_mr.analysis import landscape as landscape
from fedjax_mr.analysis import probe as probe
from fedjax_mr.analysis import stitch_figures as stitch_figures
from fedjax_mr.analysis import stitch_paper as stitch_paper
