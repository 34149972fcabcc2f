"""Pre-trained networks cut into chains of blocks (FedStitch §III).

The blocks of a model are the runs of its units (`units`) between the cuts
of a cut list, typed 'start' (takes the model input), 'end' (gives the
logits) and 'middle'. Every block carries its input/output spec (one
example's shape, `(H, W, C)`, `(T, D)` or `(D,)`), its slice of the model's
variables and a pure inference-mode apply function (`run_steps`).

References:
  Teerapittayanon et al., "StitchNet: Composing Neural Networks from
  Pre-Trained Fragments", 2023; "Heterogeneity-Aware Coordination for
  Federated Learning via Stitching Pre-trained blocks" (FedStitch), 2024.
"""

from __future__ import annotations

import functools
from typing import NamedTuple
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.models import imagenet
from fedjax_mr.models import layers
from fedjax_mr.models import lstm
from fedjax_mr.models import resnet
from fedjax_mr.models import vgg
from fedjax_mr.stitch import units as units_lib

KINDS = ('start', 'middle', 'end')


class Block(NamedTuple):
  """A contiguous run of units of one pre-trained model.

  Attributes:
    model: the pool model's id.
    index: position in the model's chain (0 = start).
    kind: 'start', 'middle' or 'end'.
    units: the unit names it spans.
    steps: the ops it runs.
    in_spec: one input example's shape.
    out_spec: one output example's shape.
    variables: the model variables the block uses (a subset of the
      model's collections, keyed by the same top-level names).
    fold: see `units.Unit.fold` (the block's first unit's).
  """

  model: str
  index: int
  kind: str
  units: tuple[str, ...]
  steps: tuple[units_lib.Step, ...]
  in_spec: tuple[int, ...]
  out_spec: tuple[int, ...]
  variables: dict
  fold: tuple[str, tuple[tuple[str, ...], ...]] | None = None

  @property
  def id(self) -> tuple[str, int]:
    return (self.model, self.index)

  @property
  def spatial_in(self) -> bool:
    """Whether the input has spatial/sequence axes (rank ≥ 2 per example)."""
    return len(self.in_spec) >= 2

  def apply(self, x: jax.Array) -> jax.Array:
    """Inference-mode forward pass `[N, *in_spec] → [N, *out_spec]`."""
    return run_steps(self.steps, self.variables, x)

  def describe(self) -> str:
    return (
      f'{self.model}[{self.index}] {self.kind} {"+".join(self.units)} '
      f'{self.in_spec}→{self.out_spec}'
    )


class _Steps(nn.Module):
  """Runs a tuple of steps in inference mode."""

  steps: tuple[units_lib.Step, ...]

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for op, name, args in self.steps:
      x = _STEP_OPS[op](x, name, args)
    return x


def _conv(x, name, args):
  features, kernel, strides, padding, bias = args
  return layers.Conv(
    features, kernel, strides, padding, use_bias=bias, name=name
  )(x)


_STEP_OPS = {
  'conv': _conv,
  'bn': lambda x, name, _: layers.batch_norm(x, False, None, name),
  'relu': lambda x, *_: nn.relu(x),
  'pool': lambda x, *_: layers.max_pool_2x2(x),
  'pool_ceil': lambda x, *_: vgg.max_pool_2x2_ceil(x),
  'flatten': lambda x, *_: x.reshape(x.shape[0], -1),
  'gap': lambda x, *_: jnp.mean(x, axis=(1, 2)),
  'gmax': lambda x, *_: jnp.max(x, axis=(1, 2)),
  'last': lambda x, *_: x[:, -1],
  'dense': lambda x, name, f: nn.Dense(f, name=name)(x),
  'embed': lambda x, name, a: nn.Embed(a[0], a[1], name=name)(
    x.astype(jnp.int32)
  ),
  'lstm': lambda x, name, h: lstm.LSTMLayer(h, name=name)(x),
  'preact': lambda x, name, a: resnet.PreActBottleneck(*a, name=name)(
    x, False, None
  ),
  'basic': lambda x, name, a: resnet.BasicBlock(*a, name=name)(x, False, None),
  # The ImageNet models (fedjax_mr.models.imagenet).
  'preprocess': lambda x, _, p: imagenet.preprocess(x, p),
  'maxpool': lambda x, _, a: imagenet.max_pool(x, *a),
  'avgpool': lambda x, _, a: imagenet.avg_pool(x, *a),
  'adaptive_avg': lambda x, _, size: imagenet.adaptive_avg_pool(x, size),
  'hardswish': lambda x, *_: jax.nn.hard_swish(x),
  'bottleneck': lambda x, name, a: imagenet.Bottleneck(*a, name=name)(x),
  'dense_layer': lambda x, name, a: imagenet.DenseLayer(*a, name=name)(x),
  'conv_bn_act': lambda x, name, a: imagenet.ConvBNAct(*a, name=name)(x),
  'inverted_residual': lambda x, name, cfg: imagenet.InvertedResidual(
    cfg, name=name
  )(x),
}


@functools.partial(jax.jit, static_argnums=0)
def run_steps(steps: tuple[units_lib.Step, ...], variables: dict, x: jax.Array):
  """Runs `steps` with `variables` on a batch `x` (inference mode).

  FedStitch is a host pipeline of many small forward passes of different
  blocks and shapes, with no round function to compile once, so this is
  the one place it compiles (per steps and input shape).
  """
  return _Steps(steps).apply(variables, x)


def _subset(variables: dict, names: Sequence[str]) -> dict:
  out = {}
  for collection, tree in variables.items():
    sub = {n: tree[n] for n in names if n in tree}
    if sub:
      out[collection] = sub
  return out


def _var_names(steps: Sequence[units_lib.Step]) -> list[str]:
  return [name for _, name, _ in steps if name]


def split(
  model: str,
  model_name: str,
  variables: dict,
  input_shape: Sequence[int],
  cuts: Sequence[str] | str = 'default',
  module: nn.Module | None = None,
) -> tuple[Block, ...]:
  """Cuts a pre-trained zoo model into typed blocks.

  Args:
    model: the id the blocks carry (e.g. 'resnet20' or 'resnet20_b').
    model_name: the zoo name (decides the units).
    variables: the pre-trained variables.
    input_shape: one input example's shape.
    cuts: a cut style (see `units.cut_list`) or explicit unit names at which
      blocks begin, in chain order; the first unit always begins a block.
    module: an ImageNet model's Flax module (its configuration and input
      preprocessing); ignored for other models.

  Returns:
    The blocks in chain order; running them in turn equals the model's
    inference-mode forward pass.

  Raises:
    ConfigError: unknown model, cut style or unit name, cuts out of order.
  """
  style = cuts if isinstance(cuts, str) else 'default'
  chain = units_lib.units(model_name, variables, style == 'per_linear', module)
  if isinstance(cuts, str):
    cuts = units_lib.cut_list(model_name, variables, cuts, module)
  names = [u.name for u in chain]
  unknown = [c for c in cuts if c not in names]
  if unknown:
    raise errors.ConfigError(
      f'`cuts` for {model_name}: unknown unit(s) {", ".join(unknown)}; units '
      f'are {", ".join(names)}'
    )
  positions = sorted({names.index(c) for c in cuts} | {0})
  if [names.index(c) for c in cuts] != sorted(names.index(c) for c in cuts):
    raise errors.ConfigError(
      f'`cuts` for {model_name}: give unit names in chain order ({cuts})'
    )
  if len(positions) < 2:
    raise errors.ConfigError(
      f'`cuts` for {model_name}: need at least two blocks'
    )
  bounds = positions + [len(chain)]
  spec = jax.ShapeDtypeStruct(
    (1, *input_shape),
    jnp.int32 if model_name == 'char_lstm' else jnp.float32,
  )
  blocks = []
  for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
    steps = tuple(s for u in chain[lo:hi] for s in u.steps)
    block_vars = _subset(variables, _var_names(steps))
    out = jax.eval_shape(functools.partial(run_steps, steps), block_vars, spec)
    kind = 'start' if b == 0 else 'end' if b == len(bounds) - 2 else 'middle'
    blocks.append(
      Block(
        model=model,
        index=b,
        kind=kind,
        units=tuple(u.name for u in chain[lo:hi]),
        steps=steps,
        in_spec=tuple(spec.shape[1:]),
        out_spec=tuple(out.shape[1:]),
        variables=block_vars,
        fold=chain[lo].fold,
      )
    )
    spec = jax.ShapeDtypeStruct(out.shape, out.dtype)
  return tuple(blocks)


def block_bytes(block: Block) -> int:
  """Bytes of the block's variables."""
  return int(
    sum(np.asarray(v).nbytes for v in jax.tree.leaves(block.variables))
  )
