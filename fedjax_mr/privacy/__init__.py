"""Privacy of a round's sum: user-level differential privacy (`dp`: the
clip of a client's update, the noise of the sum, adaptive clipping;
`private`: DP-FedAvg around an algorithm) and its accounting
(`accounting`: ε by `dp-accounting`); secure aggregation (`secure`: the
integer encoding around an algorithm, `fixed_point`). The deployed
protocol, SecAgg+ (`fedjax_mr.privacy.secagg`, with its secret sharing
`shamir`), is host code that needs `cryptography` (which the `deploy`
extra brings with flwr): imported by its module's name, not here.

Below the training layer: the engine's fold applies these functions; they
import only `core` (and the accountant, host code, `dp-accounting`).
"""

from fedjax_mr.privacy import accounting as accounting
from fedjax_mr.privacy import distributed_dp as distributed_dp
from fedjax_mr.privacy import dp as dp
from fedjax_mr.privacy import fixed_point as fixed_point
from fedjax_mr.privacy import private as private
from fedjax_mr.privacy import secure as secure
from fedjax_mr.privacy import skellam as skellam
from fedjax_mr.privacy.accounting import Accountant as Accountant
from fedjax_mr.privacy.accounting import SkellamAccountant as SkellamAccountant
from fedjax_mr.privacy.accounting import default_delta as default_delta
from fedjax_mr.privacy.dp import clip as clip
from fedjax_mr.privacy.dp import global_norm as global_norm
from fedjax_mr.privacy.dp import next_clip_norm as next_clip_norm
from fedjax_mr.privacy.dp import noise as noise
from fedjax_mr.privacy.dp import noised_fraction as noised_fraction
from fedjax_mr.privacy.dp import (
  update_noise_multiplier as update_noise_multiplier,
)

__all__ = [
  'Accountant',
  'SkellamAccountant',
  'accounting',
  'clip',
  'default_delta',
  'distributed_dp',
  'dp',
  'fixed_point',
  'global_norm',
  'next_clip_norm',
  'noise',
  'noised_fraction',
  'private',
  'secure',
  'skellam',
  'update_noise_multiplier',
]
