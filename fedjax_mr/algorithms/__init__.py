"""Federated algorithms, one module per algorithm, both sides (server and
client): `fedavg`, `fedprox`, `scaffold`, `moon`, `fedgen`, `fedexp`,
`fedasam` (FedASAM and FedSAM), `clusamp` (clustered sampling), `fedmr`
(FedMR, FedMR-p, Indep; its clients' secure recombination in
`fedmr_secure`), `fedmut`; FedStitch's baselines `heterofl`, `depthfl`,
`fedepth` and `finetune` (FT-Full, FT-Part). The programs find them
through `fedjax_mr.pipeline.registry`."""

from fedjax_mr.algorithms import clusamp as clusamp
from fedjax_mr.algorithms import depthfl as depthfl
from fedjax_mr.algorithms import fedasam as fedasam
from fedjax_mr.algorithms import fedavg as fedavg
from fedjax_mr.algorithms import fedepth as fedepth
from fedjax_mr.algorithms import fedexp as fedexp
from fedjax_mr.algorithms import fedgen as fedgen
from fedjax_mr.algorithms import fedmr as fedmr
from fedjax_mr.algorithms import fedmr_secure as fedmr_secure
from fedjax_mr.algorithms import fedmut as fedmut
from fedjax_mr.algorithms import fedprox as fedprox
from fedjax_mr.algorithms import finetune as finetune
from fedjax_mr.algorithms import heterofl as heterofl
from fedjax_mr.algorithms import moon as moon
from fedjax_mr.algorithms import scaffold as scaffold
