"""Stitched networks: a chain of blocks joined by stitches; evaluation.

A `Network` is blocks b_0 … b_d with a stitch before every block but the
first. It is *finished* when its last block is an 'end' block (its output
is that model's logits).

Evaluation of a finished network on labelled data:
* 'head': the end block's logits, mapped to the target labels by an
  explicit label map when the two label spaces differ (each target class
  owns a set of source classes; its score is the max, or the sum, of their
  logits). FedStitch keeps the ImageNet head and "aligns" labels this way.
* 'knn': a k-nearest-neighbour probe (k = 5, Euclidean, majority vote with
  ties to the nearest) on the network's outputs, fitted on a labelled
  reference set (StitchNet's evaluation for new label spaces).

References:
  FedStitch (2024) §V-A2; Teerapittayanon et al., "StitchNet", 2023 §4.
"""

from __future__ import annotations

import functools
from typing import NamedTuple
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.stitch import blocks as blocks_lib
from fedjax_mr.stitch import projection

LABEL_REDUCTIONS = ('max', 'sum')
EVAL_MODES = ('head', 'knn', 'both')


class Network(NamedTuple):
  """A stitched network.

  Attributes:
    blocks: the blocks in order.
    stitches: `stitches[i]` runs before `blocks[i]`; `stitches[0]` is None,
      and None elsewhere means nothing runs there (a model's own chain).
  """

  blocks: tuple[blocks_lib.Block, ...]
  stitches: tuple[projection.Stitch | None, ...]

  @property
  def path(self) -> tuple[tuple[str, int], ...]:
    return tuple(b.id for b in self.blocks)

  @property
  def depth(self) -> int:
    return len(self.blocks)

  @property
  def out_spec(self) -> tuple[int, ...]:
    return self.blocks[-1].out_spec

  @property
  def finished(self) -> bool:
    return self.blocks[-1].kind == 'end'

  def describe(self) -> str:
    return ' → '.join(f'{m}[{i}]' for m, i in self.path)


def start(block: blocks_lib.Block) -> Network:
  """A one-block network from a start block."""
  if block.kind != 'start':
    raise ValueError(f'{block.describe()} is not a start block')
  return Network((block,), (None,))


def extend(
  net: Network, stitch: projection.Stitch, block: blocks_lib.Block
) -> Network:
  """`net` followed by `stitch` and `block`."""
  if net.finished:
    raise ValueError(f'{net.describe()} is already finished')
  return Network((*net.blocks, block), (*net.stitches, stitch))


def trunk(net: Network) -> Network:
  """A finished network without its end block: what it computes is the
  features its end block (the classifier) starts from, which a kNN probe
  reads where the heads learnt other classes."""
  if not net.finished:
    raise ValueError(f'{net.describe()} has no end block: it is not finished')
  return Network(net.blocks[:-1], net.stitches[:-1])


@functools.partial(jax.jit, static_argnames=('pool', 'size'))
def _stitch(matrix, bias, x, pool, size):
  return projection.apply(projection.Stitch(matrix, bias, pool, size), x)


def apply_stitch(stitch: projection.Stitch, x: jax.Array) -> jax.Array:
  return _stitch(stitch.matrix, stitch.bias, x, stitch.pool, stitch.size)


def apply(net: Network, x: jax.Array) -> jax.Array:
  """Inference-mode forward pass of a (finished or partial) network."""
  for stitch, block in zip(net.stitches, net.blocks):
    if stitch is not None:
      x = apply_stitch(stitch, x)
    x = block.apply(x)
  return x


def fold(net: Network) -> Network:
  """Folds every bias-free stitch into its next block where that is exact.

  The folded network computes the same function with one matrix product
  fewer per stitch (see `projection.fold`); stitches with a bias or before
  a block without a foldable first layer stay as they are.
  """
  new_blocks, new_stitches = [net.blocks[0]], [None]
  for stitch, block in zip(net.stitches[1:], net.blocks[1:]):
    if (
      stitch is not None
      and stitch.bias is None
      and stitch.matrix is not None
      and block.fold
    ):
      stitch, block = projection.fold(stitch, block)
    new_blocks.append(block)
    new_stitches.append(stitch)
  return Network(tuple(new_blocks), tuple(new_stitches))


def map_labels(
  logits: np.ndarray,
  label_map: Sequence[Sequence[int]] | None,
  reduce: str = 'max',
) -> np.ndarray:
  """Source logits `[N, S]` → target scores `[N, T]` by a label map.

  Args:
    logits: the end block's outputs.
    label_map: for each target class, the source classes that count as it;
      None is the identity (same label space).
    reduce: 'max' or 'sum' of the source logits of each set.
  """
  if label_map is None:
    return np.asarray(logits)
  if reduce not in LABEL_REDUCTIONS:
    raise ValueError(f'reduce must be one of {LABEL_REDUCTIONS}: {reduce!r}')
  logits = np.asarray(logits)
  out = np.empty((logits.shape[0], len(label_map)), logits.dtype)
  for t, sources in enumerate(label_map):
    if not len(sources):
      raise ValueError(f'label map: target class {t} has no source classes')
    part = logits[:, list(sources)]
    out[:, t] = part.max(axis=1) if reduce == 'max' else part.sum(axis=1)
  return out


def outputs(
  net: Network,
  x: np.ndarray,
  *,
  scale: float = 1.0,
  shift: float = 0.0,
  batch_size: int = 500,
) -> np.ndarray:
  """The network's outputs on stored examples, `[N, D]` float32."""
  out = []
  for i in range(0, len(x), batch_size):
    xb = jnp.asarray(x[i : i + batch_size]).astype(jnp.float32) * scale + shift
    y = apply(net, xb)
    out.append(np.asarray(y).reshape(y.shape[0], -1))
  return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


def head_accuracy(
  net: Network,
  x: np.ndarray,
  y: np.ndarray,
  *,
  scale: float = 1.0,
  shift: float = 0.0,
  label_map: Sequence[Sequence[int]] | None = None,
  reduce: str = 'max',
  batch_size: int = 500,
) -> float:
  """Accuracy of a finished network's head (through the label map)."""
  return accuracies(
    net,
    x,
    y,
    scale=scale,
    shift=shift,
    label_map=label_map,
    reduce=reduce,
    batch_size=batch_size,
  )['head']


def accuracies(
  net: Network,
  x: np.ndarray,
  y: np.ndarray,
  *,
  scale: float = 1.0,
  shift: float = 0.0,
  head: bool = True,
  knn_reference: tuple[np.ndarray, np.ndarray] | None = None,
  label_map: Sequence[Sequence[int]] | None = None,
  reduce: str = 'max',
  k: int = 5,
  batch_size: int = 500,
) -> dict[str, float]:
  """Head and/or kNN accuracy from one forward pass over `x`.

  Args:
    net: the network (finished when `head`).
    x: stored examples to evaluate on.
    y: their labels.
    scale: model input is `x * scale + shift`.
    shift: see `scale`.
    head: report 'head', the end block's accuracy through `label_map`.
    knn_reference: (examples, labels) to fit a kNN probe on; reports 'knn'.
    label_map: see `map_labels`.
    reduce: see `map_labels`.
    k: kNN neighbours.
    batch_size: examples per forward pass.
  """
  if head and not net.finished:
    raise ValueError(f'{net.describe()} has no head: it is not finished')
  kw = dict(scale=scale, shift=shift, batch_size=batch_size)
  out = outputs(net, x, **kw)
  y = np.asarray(y)
  acc = {}
  if head:
    pred = map_labels(out, label_map, reduce).argmax(axis=1)
    acc['head'] = float(np.mean(pred == y))
  if knn_reference is not None:
    ref = outputs(net, knn_reference[0], **kw)
    pred = knn_predict(ref, knn_reference[1], out, k)
    acc['knn'] = float(np.mean(pred == y))
  return acc


def knn_predict(
  train_features: np.ndarray,
  train_labels: np.ndarray,
  features: np.ndarray,
  k: int = 5,
  chunk: int = 1024,
) -> np.ndarray:
  """k-nearest-neighbour labels (Euclidean; majority, ties to the nearest).

  Args:
    train_features: `[M, D]` reference outputs.
    train_labels: `[M]` int labels.
    features: `[N, D]` outputs to label.
    k: neighbours.
    chunk: rows of `features` per distance block (memory).
  """
  train = np.asarray(train_features, np.float64)
  labels = np.asarray(train_labels)
  k = min(k, len(train))
  sq = np.sum(train * train, axis=1)
  num_classes = int(labels.max()) + 1
  preds = []
  for i in range(0, len(features), chunk):
    f = np.asarray(features[i : i + chunk], np.float64)
    d = sq[None, :] - 2 * f @ train.T  # + |f|², the same for every row
    nearest = labels[np.argsort(d, axis=1, kind='stable')[:, :k]]
    rows = np.arange(len(f))
    counts = np.zeros((len(f), num_classes), int)
    np.add.at(counts, (rows[:, None], nearest), 1)
    # Among the most frequent labels, the one of the nearest neighbour.
    top = counts[rows[:, None], nearest] == counts.max(axis=1)[:, None]
    preds.append(nearest[rows, top.argmax(axis=1)])
  return np.concatenate(preds) if preds else np.zeros((0,), int)


def knn_accuracy(
  net: Network,
  x_ref: np.ndarray,
  y_ref: np.ndarray,
  x: np.ndarray,
  y: np.ndarray,
  *,
  scale: float = 1.0,
  shift: float = 0.0,
  k: int = 5,
  batch_size: int = 500,
) -> float:
  """Accuracy of a kNN probe on the network's outputs (any network)."""
  return accuracies(
    net,
    x,
    y,
    scale=scale,
    shift=shift,
    head=False,
    knn_reference=(x_ref, y_ref),
    k=k,
    batch_size=batch_size,
  )['knn']
