"""FedStitch: training-free federated stitching of pre-trained blocks.

Modules: `units` (the zoo's models as chains of units, their cut lists),
`blocks` (cutting a pre-trained zoo model into typed blocks),
`cka` (linear CKA, align-corners resizing), `projection` (the stitching
layer: least-squares fit, spatial policy, folding), `network` (stitched
networks, head / kNN evaluation), `pool` (training, saving and loading a
pool of pre-trained models; the block pool), `config` (FedStitch's
hyper-parameters and their checks), `client` (the client step: CKA
scoring on local data, ε-greedy uploads), `server` (RL-weighted
aggregation, block selection, the search-space optimiser), `state` (the
resumable run's state and its files), `federated` (the rounds and the
run loop), `label_maps` (bundled ImageNet label maps) and
`torchvision_import` (FedStitch's ImageNet pool from torchvision weights
in .safetensors).
"""

from fedjax_mr.stitch import blocks as blocks
from fedjax_mr.stitch import cka as cka
from fedjax_mr.stitch import client as client
from fedjax_mr.stitch import config as config
from fedjax_mr.stitch import federated as federated
from fedjax_mr.stitch import network as network
from fedjax_mr.stitch import pool as pool
from fedjax_mr.stitch import projection as projection
from fedjax_mr.stitch import server as server
from fedjax_mr.stitch import state as state
from fedjax_mr.stitch import torchvision_import as torchvision_import
from fedjax_mr.stitch import units as units
from fedjax_mr.stitch.blocks import Block as Block
from fedjax_mr.stitch.blocks import split as split
from fedjax_mr.stitch.cka import linear_cka as linear_cka
from fedjax_mr.stitch.config import Config as Config
from fedjax_mr.stitch.federated import run as run
from fedjax_mr.stitch.network import Network as Network
from fedjax_mr.stitch.pool import Pool as Pool
from fedjax_mr.stitch.pool import make_pool as make_pool
from fedjax_mr.stitch.projection import Stitch as Stitch
from fedjax_mr.stitch.units import cut_list as cut_list
