"""Networks with a classifier ("exit") after each stage, for depth-wise
heterogeneous federated learning (DepthFL, FeDepth).

`MultiExitResNet` is the zoo's CIFAR-style ResNet-18 (a 3×3 stride-1 stem,
basic-block stages [2, 2, 2, 2] with 64/128/256/512 channels and strides
1/2/2/2) with exit i after stage i. Each exit is global average pooling
and one dense layer; the last exit is exactly the zoo ResNet-18's head.
DepthFL's authors put small bottleneck stacks (depthwise-separable
convolutions with an attention mask) before the shallow exits; we keep the
simpler pooled linear head (documented in `fedjax_mr.algorithms.depthfl`).

A depth-d sub-network is the stem, stages 1..d and exits 1..d. Variables
are named so that the depth of each leaf is read off its path
(`leaf_depth`): the stem ('conv1', 'bn1') belongs to depth 1, 'layer{i}_j'
(block j of stage i) and 'exit{i}' to depth i.

`OneStage` wraps any other zoo model as a one-stage, one-exit network, so
that a depth-wise algorithm runs on every model (degenerately: one depth).

Called as the zoo's modules (`module(x, train=..., mask=...)`), a
multi-exit module returns one logits array `[B, C]`: the mean of the exits'
logits (`inference='ensemble'`, DepthFL's prediction) or the deepest exit's
(`inference='last'`); with `all_exits=True` it returns every exit's logits
`[B, D, C]`.
"""

from __future__ import annotations

import re
from typing import Any
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_mr.models import layers
from fedjax_mr.models import model as model_lib
from fedjax_mr.models import resnet

INFERENCE = ('ensemble', 'last')
# Zoo ResNet-18s and their first stage's channels (`from_zoo`).
RESNET18_WIDTHS = {'resnet18': 64, 'resnet18_w16': 16}
_DEPTH_NAME = re.compile(r'^(?:layer|exit)(\d+)(?:_|$)')


def _combine(exits: list[jax.Array], inference: str, all_exits: bool):
  stacked = jnp.stack(exits, axis=1)  # [B, D, C]
  if all_exits:
    return stacked
  if inference == 'last':
    return exits[-1]
  return jnp.mean(stacked, axis=1)


class MultiExitResNet(nn.Module):
  """A ResNet of basic-block stages with an exit after each stage.

  Attributes:
    num_classes: C.
    widths: channels of each stage (ResNet-18: 64, 128, 256, 512); the
      first stage has stride 1, the others 2.
    blocks: basic blocks per stage (ResNet-18: 2 each).
    depth: build only stages and exits 1..depth (0: all); used to measure
      a sub-network's training memory.
    inference: what a plain call returns, see `INFERENCE`.
  """

  num_classes: int
  widths: Sequence[int] = (64, 128, 256, 512)
  blocks: Sequence[int] = (2, 2, 2, 2)
  depth: int = 0
  inference: str = 'ensemble'

  def num_stages(self) -> int:
    return len(self.widths) if self.depth == 0 else self.depth

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    train: bool = False,
    mask: jax.Array | None = None,
    *,
    all_exits: bool = False,
  ) -> jax.Array:
    stages = self.num_stages()
    x = layers.Conv(
      self.widths[0],
      (3, 3),
      padding=((1, 1), (1, 1)),
      use_bias=False,
      name='conv1',
    )(x)
    x = nn.relu(layers.batch_norm(x, train, mask, 'bn1'))
    exits = []
    for i in range(stages):
      for j in range(self.blocks[i]):
        stride = 2 if (i > 0 and j == 0) else 1
        x = resnet.BasicBlock(self.widths[i], stride, name=f'layer{i + 1}_{j}')(
          x, train, mask
        )
      pooled = jnp.mean(x, axis=(1, 2))
      exits.append(nn.Dense(self.num_classes, name=f'exit{i + 1}')(pooled))
    return _combine(exits, self.inference, all_exits)


class OneStage(nn.Module):
  """Any zoo module as a one-stage network whose only exit is its head."""

  inner: nn.Module
  depth: int = 0  # accepted for a uniform interface; one stage only

  def num_stages(self) -> int:
    return 1

  @nn.compact
  def __call__(self, x, train=False, mask=None, *, all_exits=False):
    logits = self.inner(x, train=train, mask=mask)
    return logits[:, None] if all_exits else logits


def num_exits(module: nn.Module) -> int:
  """D, the number of stages (and exits) of a multi-exit module (any
  module with a `num_stages()` method, its `depth` attribute building the
  first stages only)."""
  if not hasattr(module, 'num_stages'):
    raise TypeError(f'not a multi-exit module: {type(module).__name__}')
  return module.num_stages()


def leaf_depth(path: Sequence[Any]) -> int:
  """The shallowest depth whose sub-network holds the leaf at `path` (a
  `jax.tree_util` key path or a tuple of names, collection name first)."""
  for k in path:
    name = str(getattr(k, 'key', getattr(k, 'name', k)))
    found = _DEPTH_NAME.match(name)
    if found:
      return int(found.group(1))
  return 1


def leaf_depths(variables: Any) -> Any:
  """The tree of `leaf_depth`s (Python ints) of `variables`' leaves."""
  return jax.tree_util.tree_map_with_path(lambda p, _: leaf_depth(p), variables)


def resnet18(
  num_classes: int,
  input_shape: tuple[int, ...],
  inference: str = 'ensemble',
  **changes: Any,
) -> model_lib.Model:
  """The multi-exit ResNet-18 as a `Model` (`changes`: other `widths`,
  `blocks` for small test networks)."""
  if inference not in INFERENCE:
    raise ValueError(f'inference must be one of {INFERENCE}, got {inference}')
  module = MultiExitResNet(num_classes, inference=inference, **changes)
  return model_lib.Model(
    'resnet18_multi_exit', module, tuple(input_shape), num_classes
  )


def from_zoo(model: model_lib.Model, inference: str = 'ensemble'):
  """The multi-exit network for zoo model `model`: ResNet-18 gets its four
  exits; any other model is one stage (`OneStage`)."""
  if model.name in RESNET18_WIDTHS:
    width = RESNET18_WIDTHS[model.name]
    return resnet18(
      model.num_classes,
      model.input_shape,
      inference,
      widths=tuple(width * m for m in (1, 2, 4, 8)),
    )
  module = OneStage(model.module.clone(parent=None, name='inner'))
  return model._replace(name=f'{model.name}+one_stage', module=module)


def at_depth(model: model_lib.Model, depth: int) -> model_lib.Model:
  """The depth-`depth` sub-network of a multi-exit `model` (stages and
  exits 1..depth only; a plain call gives its exits' mean)."""
  module = model.module
  if isinstance(module, OneStage):
    return model
  changes = {'depth': depth}
  if hasattr(module, 'inference'):
    changes['inference'] = 'ensemble'
  return model._replace(module=module.clone(**changes))
