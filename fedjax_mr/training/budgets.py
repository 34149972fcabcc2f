"""Client memory budgets and the training memory of a model.

FedStitch's comparison (Zhan et al., "Heterogeneity-Aware Coordination for
Federated Learning via Stitching Pre-trained blocks", 2024, §V-A) splits
the clients into four groups of 30, 30, 30 and 10 % with memory budgets of
1, 2, 4 and 8 GB; a memory-constrained baseline gives each client the
largest sub-model (HeteroFL: a width, DepthFL and FeDepth: a depth) whose
training fits its budget, and fine-tuning (FT-Full, FT-Part) lets a client
take part only when its budget holds the model's training.

The training memory of a model is *measured*, not estimated from parameter
counts: `training_memory_bytes` compiles one SGD step (forward, backward,
parameter update) of the model for a batch and reads XLA's buffer
assignment (arguments + outputs + temporaries − aliased bytes), which is
the peak the step needs on the backend it was compiled for. It is
measured at a *reference setting* (an input shape and batch size, by
default the FedStitch pool's 224 × 224 × 3 images in batches of 32), so
that the paper's budgets in GB mean what they mean on the devices, while
the experiment itself may train on small images.
"""

from __future__ import annotations

import dataclasses
from typing import Callable
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_mr.core import errors
from fedjax_mr.models import layers
from fedjax_mr.models import model as model_lib

GB = 1 << 30
# FedStitch §V-A: budgets of the four client groups and their shares.
PAPER_BUDGETS_GB = (1.0, 2.0, 4.0, 8.0)
PAPER_FRACTIONS = (0.3, 0.3, 0.3, 0.1)
# The reference setting the budgets are compared at: the pool's ImageNet
# resolution; FedStitch does not state its batch size, 32 is ours.
REFERENCE_INPUT_SHAPE = (224, 224, 3)
REFERENCE_BATCH_SIZE = 32


def _numbers(text: str, name: str) -> tuple[float, ...]:
  try:
    return tuple(float(v) for v in str(text).split(',') if v.strip())
  except ValueError:
    raise errors.ArgumentError(
      name, f'must be comma-separated numbers, got {text!r}'
    ) from None


@dataclasses.dataclass(frozen=True)
class BudgetHparams:
  """The clients' memory budgets and the setting their training memory is
  measured at: the hyper-parameters every memory-constrained baseline
  (HeteroFL, FeDepth, FT-Full, FT-Part) inherits, as the flags
  `--<algorithm>_budgets_gb` and so on."""

  budgets_gb: str = ','.join(f'{b:g}' for b in PAPER_BUDGETS_GB)
  budget_fractions: str = ','.join(f'{f:g}' for f in PAPER_FRACTIONS)
  budget_seed: int = 0
  reference_size: int = REFERENCE_INPUT_SHAPE[0]
  reference_batch: int = REFERENCE_BATCH_SIZE

  def budgets(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(budgets in GB, their shares of the clients)."""
    return (
      _numbers(self.budgets_gb, 'budgets_gb'),
      _numbers(self.budget_fractions, 'budget_fractions'),
    )

  def validate_budgets(self) -> None:
    """Raises `ArgumentError` naming a bad budget field."""
    gbs, fractions = self.budgets()
    if not gbs or not all(b > 0 for b in gbs):
      raise errors.ArgumentError(
        'budgets_gb', f'must be numbers > 0, got {self.budgets_gb!r}'
      )
    if (
      len(fractions) != len(gbs)
      or any(f < 0 for f in fractions)
      or abs(sum(fractions) - 1) > 1e-6
    ):
      raise errors.ArgumentError(
        'budget_fractions',
        'must be one share ≥ 0 per budget, summing to 1, got '
        f'{self.budget_fractions!r}',
      )
    if self.reference_size < 0:
      raise errors.ArgumentError(
        'reference_size', f'must be ≥ 0, got {self.reference_size}'
      )
    if self.reference_batch < 1:
      raise errors.ArgumentError(
        'reference_batch', f'must be ≥ 1, got {self.reference_batch}'
      )


def group_sizes(num_clients: int, fractions: Sequence[float]) -> np.ndarray:
  """How many of `num_clients` clients fall in each group: the largest
  remainder rounding of `fractions · num_clients` (sums to num_clients).

  Raises:
    ConfigError: a negative fraction or fractions that do not sum to 1.
  """
  f = np.asarray(fractions, np.float64)
  if f.ndim != 1 or f.size == 0 or np.any(f < 0) or abs(f.sum() - 1) > 1e-6:
    raise errors.ConfigError(
      f'budget fractions must be ≥ 0 and sum to 1, got {list(fractions)}'
    )
  exact = f * num_clients
  sizes = np.floor(exact).astype(np.int64)
  order = np.argsort(-(exact - sizes), kind='stable')
  sizes[order[: num_clients - int(sizes.sum())]] += 1
  return sizes


def client_budgets(
  num_clients: int,
  seed: int,
  budgets_gb: Sequence[float] = PAPER_BUDGETS_GB,
  fractions: Sequence[float] = PAPER_FRACTIONS,
) -> np.ndarray:
  """Each client's memory budget in bytes, `[num_clients]` int64.

  Group g holds `group_sizes(num_clients, fractions)[g]` clients with
  budget `budgets_gb[g]`; which clients form which group is a seeded
  permutation (independent of the data partition).

  Raises:
    ConfigError: mismatched lengths or a non-positive budget.
  """
  if len(budgets_gb) != len(fractions):
    raise errors.ConfigError(
      f'{len(budgets_gb)} budgets but {len(fractions)} fractions'
    )
  if any(b <= 0 for b in budgets_gb):
    raise errors.ConfigError(
      f'memory budgets must be > 0 GB, got {list(budgets_gb)}'
    )
  sizes = group_sizes(num_clients, fractions)
  per_client = np.repeat(
    np.round(np.asarray(budgets_gb, np.float64) * GB).astype(np.int64), sizes
  )
  return per_client[np.random.default_rng(seed).permutation(num_clients)]


def step_memory_bytes(fn: Callable, *args) -> int:
  """Peak bytes of one call of `jax.jit(fn)` on `args` (arrays or
  `jax.ShapeDtypeStruct`s), from the compiled executable's buffer
  assignment: arguments + outputs + temporaries − aliased bytes. Nothing
  runs; only compilation for the default backend."""
  compiled = jax.jit(fn).lower(*args).compile()
  stats = compiled.memory_analysis()
  if stats is None:
    raise RuntimeError(
      f'the {jax.default_backend()} backend reports no memory analysis'
    )
  return int(
    stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    + stats.temp_size_in_bytes
    - stats.alias_size_in_bytes
  )


def training_memory_bytes(
  model: model_lib.Model,
  batch_size: int = REFERENCE_BATCH_SIZE,
  input_shape: Sequence[int] | None = REFERENCE_INPUT_SHAPE,
  trainable: Callable[[tuple[str, ...]], bool] | None = None,
) -> int:
  """Measured memory of one SGD training step of `model`.

  Args:
    model: a zoo `Model` (any network whose parameters do not depend on
      the input size, e.g. with global pooling, may be measured at another
      `input_shape` than it trains on).
    batch_size: examples per step.
    input_shape: one example's shape at which to measure; None: the
      model's own.
    trainable: optional predicate on a parameter's path (tuple of keys in
      `params`); parameters it rejects are frozen: no gradient, no update
      (FT-Part). None: all parameters train.

  Returns:
    Bytes: variables, the batch, activations kept for the backward pass,
    gradients and the updated variables.
  """
  shape = tuple(model.input_shape if input_shape is None else input_shape)
  measured = model._replace(input_shape=shape)
  variables = jax.eval_shape(measured.init, jax.random.key(0))
  params = variables['params']
  paths = [
    tuple(getattr(k, 'key', getattr(k, 'name', k)) for k in p)
    for p, _ in jax.tree_util.tree_leaves_with_path(params)
  ]
  leaves, treedef = jax.tree_util.tree_flatten(params)
  train_mask = [trainable is None or trainable(p) for p in paths]
  trained = [leaf for leaf, t in zip(leaves, train_mask) if t]
  frozen = [leaf for leaf, t in zip(leaves, train_mask) if not t]
  others = {k: v for k, v in variables.items() if k != 'params'}
  x = jax.ShapeDtypeStruct((batch_size, *shape), model.input_dtype)
  y = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
  key = jax.random.key(0)

  def step(trained, frozen, others, x, y):
    def loss_fn(trained):
      t, f = iter(trained), iter(frozen)
      merged = [next(t) if m else next(f) for m in train_mask]
      v = dict(others, params=jax.tree_util.tree_unflatten(treedef, merged))
      logits, state = measured.apply_train(v, x, key)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
      return loss.mean(), state

    grads, state = jax.grad(loss_fn, has_aux=True)(trained)
    new = jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, trained, grads)
    return new, state

  # Measured with the convolution gradient a device's framework runs
  # (convolutions), not the CPU's im2col one, whose patch matrices would
  # make the figure a property of this machine.
  with layers.conv_implementation('conv'):
    return step_memory_bytes(step, trained, frozen, others, x, y)


def largest_fitting(budgets: np.ndarray, needs: Sequence[int]) -> np.ndarray:
  """For each budget, the index of the largest need that fits in it.

  Args:
    budgets: `[N]` bytes.
    needs: the candidates' memory in bytes (any order).

  Returns:
    `[N]` int64: the index into `needs` of the largest need ≤ the budget
    (ties: the first such index), −1 where none fits.
  """
  needs = np.asarray(needs, np.int64)
  budgets = np.asarray(budgets, np.int64)
  out = np.full(budgets.shape, -1, np.int64)
  best = np.full(budgets.shape, -1, np.int64)
  for i, need in enumerate(needs):
    take = (need <= budgets) & (need > best)
    out = np.where(take, i, out)
    best = np.where(take, need, best)
  return out
