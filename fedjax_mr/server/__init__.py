"""Server transforms, one module per algorithm (`fedavg.fedavg(...)`, …)."""

from fedjax_mr.server import fedavg as fedavg
from fedjax_mr.server import fedmr as fedmr
from fedjax_mr.server import fedmut as fedmut
