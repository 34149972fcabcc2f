"""FedMR: federated learning by layer-wise model recombination.

The server keeps K models instead of one. Every round model i trains on the
i-th sampled client; the server then shuffles every layer of the K trained
models independently among them (one random permutation of the K models per
layer) and dispatches the K recombined models. The global model, used only
for evaluation, is the (unweighted) mean of the K trained models.

Variants:
- Two-stage training: for the first `first_stage_bound` rounds the K models
  are reset to the global mean after training (FedAvg with an unweighted
  mean); recombination starts at the end of round `first_stage_bound`
  (rounds counted from 0).
- FedMR-p: the layers, in model order, are cut into `num_segments`
  contiguous segments and one permutation is drawn per segment;
  `num_segments=1` is "Indep": whole models are re-dispatched at random and
  never mixed.
- Secure recombination (paper 002, Appendix B, Algorithm 2): before upload
  the clients swap random layers among themselves, so the server only sees
  an already recombined stack (see `fedjax_mr.algorithms.fedmr_secure`).

A layer is every leaf of the variables, params and BatchNorm statistics
alike (as in the authors' code), or every module with `grouping='module'`;
see `fedjax_mr.core.grouping`.

References:
  Hu et al., "FedMR: Federated Learning via Model Recombination" (Algorithm
  1; Appendix B, Algorithm 2 and Eqs. 26-27 for secure recombination), and
  "Is Aggregation the Only Choice? Federated Learning via Layer-wise Model
  Recombination", KDD 2024 (two-stage training, FedMR-p, Fig. 6 cosine).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fedjax_mr.algorithms import fedmr_secure
from fedjax_mr.core import errors
from fedjax_mr.core import grouping as grouping_lib
from fedjax_mr.core import tree
from fedjax_mr.core import types
from fedjax_mr.training import client

# The largest round index: rounds are counted in int32.
_MAX_ROUND = 2**31 - 1


def permute(
  client_params: types.PyTree,
  permutations: jax.Array,
  *,
  grouping: grouping_lib.Grouping = 'leaf',
  num_segments: int | None = None,
  layer_order: Sequence[str] | None = None,
) -> types.PyTree:
  """Recombines K models with given permutations, one per unit.

  Args:
    client_params: leaves `[K, ...]`.
    permutations: `[G, K]` integers, a permutation of `range(K)` per unit,
      the units (layers or segments) in model order as
      `grouping.layer_groups` lists them.
    grouping: see `grouping.layer_groups`.
    num_segments: see `grouping.layer_groups`.
    layer_order: see `grouping.leaves`.

  Returns:
    The same structure; row i of unit g is row `permutations[g, i]` of
    `client_params`. Identity permutations return `client_params`.
  """
  layers = grouping_lib.layer_groups(
    client_params,
    grouping=grouping,
    num_segments=num_segments,
    layer_order=layer_order,
  )
  if permutations.shape[0] != len(layers):
    raise ValueError(
      f'{permutations.shape[0]} permutations for {len(layers)} units'
    )
  return fedmr_secure.permute_layers(client_params, permutations, layers)


def recombine(
  key: jax.Array,
  client_params: types.PyTree,
  *,
  grouping: grouping_lib.Grouping = 'leaf',
  num_segments: int | None = None,
  layer_order: Sequence[str] | None = None,
) -> types.PyTree:
  """Shuffles each layer (or segment) of K models among them.

  Every unit, a layer (`grouping` 'leaf': each leaf; 'module': all leaves of
  one module) or, with `num_segments`, a contiguous segment of layers in
  model order, gets its own uniformly random permutation of the K models,
  drawn from a key derived from the unit's name (`grouping.layer_keys`).
  Params and BatchNorm statistics are treated alike. Jit-compatible.

  Args:
    key: PRNG key.
    client_params: the K models, leaves `[K, ...]`.
    grouping: 'leaf' or 'module', see `grouping.layer_groups`.
    num_segments: None (one permutation per layer) or the number of
      contiguous segments (FedMR-p); 1 permutes whole models only (Indep).
    layer_order: leaf names in model order (`grouping.model_order` of fresh
      variables); only segments depend on it.

  Returns:
    The recombined models, same structure and shapes `[K, ...]`: each row
    of each unit is one row of the input, and every input row of a unit is
    used exactly once.

  References:
    Hu et al., "FedMR: Federated Learning via Model Recombination",
    Algorithm 1 (ModelRecombine); FedMR-p in the KDD 2024 version.
  """
  layers = grouping_lib.layer_groups(
    client_params,
    grouping=grouping,
    num_segments=num_segments,
    layer_order=layer_order,
  )
  k = fedmr_secure.stack_size(client_params)
  keys = grouping_lib.layer_keys(key, layers)
  return fedmr_secure.permute_layers(
    client_params, grouping_lib.unit_permutations(keys, k), layers
  )


# ---------------------------------------------------------------------------
# The algorithm.


def next_models(
  key: jax.Array,
  uploaded: types.PyTree,
  global_params: types.PyTree,
  round_index: jax.Array,
  *,
  first_stage_bound: int = 0,
  grouping: grouping_lib.Grouping = 'leaf',
  num_segments: int | None = None,
  layer_order: Sequence[str] | None = None,
) -> types.PyTree:
  """The K models FedMR dispatches after round `round_index`.

  Args:
    key: PRNG key of the recombination.
    uploaded: the K models the server received, leaves `[K, ...]`.
    global_params: their mean, the global model.
    round_index: int32 scalar, the round (from 0).
    first_stage_bound: rounds of the first (aggregation) stage.
    grouping, num_segments, layer_order: see `recombine`.

  Returns:
    Leaves `[K, ...]`: K copies of `global_params` while `round_index` <
    `first_stage_bound` (two-stage training), else `recombine(key,
    uploaded, ...)`.
  """
  k = fedmr_secure.stack_size(uploaded)

  def reset():
    return tree.broadcast(global_params, k)

  def mix():
    return recombine(
      key,
      uploaded,
      grouping=grouping,
      num_segments=num_segments,
      layer_order=layer_order,
    )

  if first_stage_bound == 0:
    return mix()
  return lax.cond(round_index < first_stage_bound, reset, mix)


def _check_options(
  k, bound, grouping, num_segments, layer_order, repeats, weighted_global
):
  """Raises `ValueError` for inconsistent arguments of `fedmr`."""
  errors.check_count('clients_per_round', k)
  if not 0 <= bound <= _MAX_ROUND:
    raise ValueError(
      f'first_stage_bound must be in [0, {_MAX_ROUND}] (rounds are int32), '
      f'got {bound}'
    )
  if grouping not in grouping_lib.GROUPINGS:
    raise ValueError(f'grouping must be one of {grouping_lib.GROUPINGS}')
  if num_segments is not None and int(num_segments) < 1:
    raise ValueError(f'num_segments must be >= 1, got {num_segments}')
  if num_segments not in (None, 1) and layer_order is None:
    raise ValueError(
      'num_segments > 1 cuts the model into contiguous segments and needs '
      'layer_order=grouping.model_order(model.init(key)): inside jax the '
      'variables dicts have sorted keys, not model order'
    )
  if repeats < 0:
    raise ValueError(f'secure_repeats must be >= 0, got {repeats}')
  if repeats and weighted_global:
    raise ValueError('weighted_global is not available with secure_repeats')
  if repeats and k < 2:
    raise ValueError('secure recombination needs clients_per_round >= 2')


class FedMRState(NamedTuple):
  """Attributes:
  params: the global model (mean of the K trained models, params and
    BatchNorm statistics alike), for evaluation only.
  client_models: the K models to dispatch next, leaves `[K, ...]`.
  """

  params: types.Variables
  client_models: types.Variables


def _make_aggregate(
  k: int,
  *,
  weighted_global: bool,
  secure_repeats: int,
  secure_min_sent: int,
  secure_max_sent: int | None,
  first_stage_bound: int,
  grouping: grouping_lib.Grouping,
  num_segments: int | None,
  layer_order: Sequence[str] | None,
) -> Callable[..., tuple[FedMRState, dict[str, jax.Array]]]:
  """FedMR's server side, `aggregate(state, outputs, client_ids,
  round_index, key)`: secure recombination (when `secure_repeats`), the
  global mean, then `next_models`. The arguments are `fedmr`'s, checked
  here (`_check_options`)."""
  secure_repeats = int(secure_repeats)
  first_stage_bound = int(first_stage_bound)
  _check_options(
    k,
    first_stage_bound,
    grouping,
    num_segments,
    layer_order,
    secure_repeats,
    weighted_global,
  )

  def aggregate(state, outputs, client_ids, round_index, key):
    del state, client_ids
    k_secure, k_mix = jax.random.split(key)
    uploaded = outputs.variables
    model_bytes = tree.nbytes(outputs.variables) // k
    client_bytes = jnp.zeros((), jnp.float32)
    if secure_repeats:
      # From here on the server only sees `uploaded`.
      uploaded, client_bytes = fedmr_secure.secure_upload(
        k_secure,
        uploaded,
        repeats=secure_repeats,
        min_sent=secure_min_sent,
        max_sent=secure_max_sent,
        grouping=grouping,
      )
    weights = outputs.num_examples if weighted_global else None
    global_params = tree.weighted_mean(uploaded, weights)
    client_models = next_models(
      k_mix,
      uploaded,
      global_params,
      round_index,
      first_stage_bound=first_stage_bound,
      grouping=grouping,
      num_segments=num_segments,
      layer_order=layer_order,
    )
    metrics = {
      'pairwise_cosine': tree.pairwise_cosine(uploaded),
      'bytes_communicated': jnp.float32(2 * k * model_bytes) + client_bytes,
    }
    return FedMRState(global_params, client_models), metrics

  return aggregate


def fedmr(
  local: client.LocalTraining,
  clients_per_round: int,
  first_stage_bound: int = 0,
  grouping: grouping_lib.Grouping = 'leaf',
  num_segments: int | None = None,
  secure_repeats: int = 0,
  weighted_global: bool = False,
  *,
  secure_min_sent: int = 1,
  secure_max_sent: int | None = None,
  layer_order: Sequence[str] | None = None,
) -> types.Algorithm:
  """Builds FedMR.

  Round r (counted from 0): model i of `client_models` trains on the i-th
  sampled client; then
  1. with `secure_repeats > 0`, the clients run secure recombination among
     themselves before upload, so the server only ever sees the mixed stack
     (simulated with `fedmr_secure.secure_plan`);
  2. the global model is the mean of the uploaded models;
  3. if r < `first_stage_bound` every model is reset to the global model
     (two-stage training; first_stage_bound >= the number of rounds is
     unweighted FedAvg), else the uploaded models are recombined.
  The server's own recombination also runs after secure recombination: a
  uniform permutation composed with an independent one is uniform, so the
  dispatched models have the same distribution either way.

  Args:
    local: how clients train (model, optimizer, E, B); client k trains
      model k of the dispatch's per-client part.
    clients_per_round: K, the number of models.
    first_stage_bound: rounds of the aggregation stage (0: recombine from
      round 0).
    grouping: 'leaf' (default, as the reference) or 'module'.
    num_segments: None, or the number of contiguous segments (FedMR-p);
      1 is Indep.
    secure_repeats: r_s, 0 for no secure recombination.
    weighted_global: weight the global model (and the first-stage reset) by
      the clients' numbers of examples instead of the papers' plain mean.
      Not available with secure recombination (the server cannot match
      tensors to clients).
    secure_min_sent: n_l of secure recombination.
    secure_max_sent: n_u of secure recombination; None: the number of
      layers.
    layer_order: leaf names in model order, `grouping.model_order` of the
      variables `module.init` returns; required for `num_segments` > 1,
      since jax re-sorts dict keys.

  Returns:
    An `Algorithm` whose server state is a `FedMRState`. Metrics:
    'pairwise_cosine' (`tree.pairwise_cosine` of the uploaded models) and
    'bytes_communicated' (K models down, K up, plus secure recombination's
    client-to-client traffic), float32 scalars.

  Raises:
    ValueError: inconsistent options.

  References:
    Hu et al., "FedMR: Federated Learning via Model Recombination",
    Algorithms 1 and 2; KDD 2024 version for two-stage training and FedMR-p.
  """
  k = int(clients_per_round)
  aggregate = _make_aggregate(
    k,
    weighted_global=weighted_global,
    secure_repeats=secure_repeats,
    secure_min_sent=secure_min_sent,
    secure_max_sent=secure_max_sent,
    first_stage_bound=first_stage_bound,
    grouping=grouping,
    num_segments=num_segments,
    layer_order=layer_order,
  )
  init = functools.partial(_init, k)
  update = client.trains_per_client(client.make_local_update(local))
  return types.Algorithm(
    init, _dispatch, update, aggregate, clients_per_round=k
  )


def _init(k: int, variables: types.Variables) -> FedMRState:
  return FedMRState(
    params=variables, client_models=tree.broadcast(variables, k)
  )


def _dispatch(
  state: FedMRState,
  client_ids: jax.Array,
  round_index: jax.Array,
  key: jax.Array,
) -> types.Dispatch:
  """Model i of `client_models` to the i-th sampled client."""
  del client_ids, round_index, key
  return types.Dispatch(per_client=state.client_models)


# ---------------------------------------------------------------------------
# Hyper-parameters (config fields `fedmr_<field>`) and the registry's
# factories.


@dataclasses.dataclass(frozen=True)
class Hparams:
  """FedMR's and Indep's hyper-parameters (config fields `fedmr_<field>`)."""

  first_stage: int = 0
  grouping: str = 'leaf'
  secure_repeats: int = 0
  secure_min_sent: int = 1
  secure_max_sent: int = 0

  def validate(
    self, *, clients_per_round=None, weighted=None, **setting
  ) -> None:
    """Raises `ArgumentError` naming a bad field or setting."""
    del setting
    for name in (
      'first_stage',
      'secure_repeats',
      'secure_min_sent',
      'secure_max_sent',
    ):
      if getattr(self, name) < 0:
        raise errors.ArgumentError(
          name, f'must be >= 0, got {getattr(self, name)}'
        )
    if self.first_stage > _MAX_ROUND:
      # The round index is an int32 in the round state.
      raise errors.ArgumentError(
        'first_stage', f'must be <= {_MAX_ROUND}, got {self.first_stage}'
      )
    if self.grouping not in grouping_lib.GROUPINGS:
      raise errors.ArgumentError(
        'grouping',
        f'must be one of {", ".join(grouping_lib.GROUPINGS)}, got '
        f'{self.grouping!r}',
      )
    if self.secure_repeats:
      if weighted:
        raise errors.ArgumentError(
          'weighted',
          'by examples is not available with secure recombination: after '
          'it the server cannot tell which client a layer came from',
        )
      if clients_per_round is not None and clients_per_round < 2:
        raise errors.ArgumentError(
          'clients_per_round',
          f'must be >= 2 for secure recombination, got {clients_per_round}',
        )
      hi = self.secure_max_sent
      if hi and self.secure_min_sent > hi:
        raise errors.ArgumentError(
          'secure_min_sent',
          f'must not exceed secure_max_sent={hi}, got {self.secure_min_sent}',
        )


@dataclasses.dataclass(frozen=True)
class PHparams(Hparams):
  """FedMR-p: FedMR's hyper-parameters and the number of segments."""

  segments: int = 2

  def validate(self, **setting) -> None:
    super().validate(**setting)
    if self.segments < 2:
      raise errors.ArgumentError(
        'segments',
        f'must be >= 2 for FedMR-p, got {self.segments} (one segment is '
        'Indep: `algorithm=indep`)',
      )


def _build(setting: Any, hp: Hparams, num_segments: int | None):
  k = setting.clients_per_round
  repeats = hp.secure_repeats
  max_sent = hp.secure_max_sent or None
  if repeats:
    layers = fedmr_secure.secure_layers(setting.variables, hp.grouping)
    num_layers = len(layers)
    hi = max_sent or num_layers
    if not hp.secure_min_sent <= hi <= num_layers:
      raise errors.ArgumentError(
        'secure_max_sent',
        f'(n_u = {hi}) and secure_min_sent (n_l = {hp.secure_min_sent}) '
        f'must satisfy n_l <= n_u <= {num_layers}, the number of layers of '
        f'the model with grouping {hp.grouping}',
      )
  return fedmr(
    setting.local,
    k,
    first_stage_bound=hp.first_stage,
    grouping=hp.grouping,
    num_segments=num_segments,
    secure_repeats=repeats,
    weighted_global=setting.weighted,
    secure_min_sent=hp.secure_min_sent,
    secure_max_sent=max_sent,
    layer_order=grouping_lib.model_order(setting.variables),
  )


def build(setting: Any, hp: Hparams) -> types.Algorithm:
  """FedMR for the registry: one permutation per layer."""
  return _build(setting, hp, None)


def build_p(setting: Any, hp: PHparams) -> types.Algorithm:
  """FedMR-p for the registry: `hp.segments` contiguous segments."""
  return _build(setting, hp, hp.segments)


def build_indep(setting: Any, hp: Hparams) -> types.Algorithm:
  """Indep for the registry: whole models re-dispatched, never mixed."""
  return _build(setting, hp, 1)
