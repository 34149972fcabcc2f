"""What a run keeps and where it runs, below the run pipeline and the
analysis of finished runs: `checkpoint` (orbax, with a digest checked on
restore), `metrics_io` (the metrics.jsonl rows), `plots` (figures of those
rows and of loss landscapes), `tensorboard` (the rows as event files),
`provenance` (what code and machine made a run) and `distributed` (devices,
meshes, processes, the client mapping). It imports nothing above the
models.
"""

from fedjax_mr.runtime import checkpoint as checkpoint
from fedjax_mr.runtime import distributed as distributed
from fedjax_mr.runtime import metrics_io as metrics_io
from fedjax_mr.runtime import plots as plots
from fedjax_mr.runtime import provenance as provenance
from fedjax_mr.runtime import tensorboard as tensorboard
