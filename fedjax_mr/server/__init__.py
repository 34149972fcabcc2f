"""Server transforms, one module per algorithm (`fedavg.fedavg(...)`, …)."""

from fedjax_mr.server import fedavg as fedavg
