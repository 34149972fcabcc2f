"""Datasets, partitions and on-device client data."""

from fedjax_mr.data import cinic as cinic
from fedjax_mr.data import client_data as client_data
from fedjax_mr.data import datasets as datasets
from fedjax_mr.data import idx as idx
from fedjax_mr.data import leaf as leaf
from fedjax_mr.data import partition as partition
from fedjax_mr.data import prepare as prepare
from fedjax_mr.data.client_data import ClientData as ClientData
from fedjax_mr.data.client_data import EvalData as EvalData
from fedjax_mr.data.client_data import eval_data as eval_data
from fedjax_mr.data.client_data import from_partition as from_partition
from fedjax_mr.data.datasets import Dataset as Dataset
from fedjax_mr.data.datasets import load as load
from fedjax_mr.data.datasets import natural_clients as natural_clients
