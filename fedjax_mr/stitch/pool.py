"""A pool of pre-trained models on disk (training, saving, loading), and
the block pool FedStitch searches (`Pool`: every block of every model).

FedStitch's pool is ImageNet-pre-trained; our machines cannot download
those weights, so `experiments.pretrain_zoo` trains zoo models centrally on a
held-out "public" part of a dataset's training split. Any Flax checkpoint of
a zoo model loads the same way.

Layout of a pool folder:

    <pool>/public.json          {"dataset", "seed", "indices": [...]} (optional)
    <pool>/<model id>/meta.json {"model": zoo name, "num_classes",
                                 "input_shape", ...}
    <pool>/<model id>/variables/  an orbax checkpoint of the Flax variables
"""

from __future__ import annotations

import json
import os
import time
from typing import Any
from typing import NamedTuple
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from fedjax_mr import models as models_lib
from fedjax_mr.core import errors
from fedjax_mr.core import files
from fedjax_mr.core import jsonfile
from fedjax_mr.stitch import blocks as blocks_lib


class PoolModel(NamedTuple):
  """A pre-trained model of the pool.

  Attributes:
    id: its id in the pool (the folder name).
    model: the zoo `Model`.
    variables: pre-trained variables.
    meta: the metadata saved with it.
  """

  id: str
  model: models_lib.Model
  variables: dict
  meta: dict


def split_public(
  num_train: int, public_size: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
  """(public indices, client indices): a seeded disjoint split, both sorted."""
  if not 0 < public_size < num_train:
    raise errors.ConfigError(
      f'`public_size` must be in (0, {num_train}), got {public_size}'
    )
  perm = np.random.default_rng(seed).permutation(num_train)
  return np.sort(perm[:public_size]), np.sort(perm[public_size:])


def write_public_split(
  workdir: str,
  dataset: str,
  public: np.ndarray,
  public_size: int,
  seed: int,
  classes: Sequence[int] | None,
) -> dict[str, Any]:
  """Writes the pool folder `workdir`'s public split, `public.json`
  (`public`: the indices `split_public` drew from `dataset`'s training
  split; `classes`: those the pool learns, None: all); refuses a folder
  whose pool was trained on another split. The caller holds the folder's
  lock.

  Returns:
    The split as written: {'dataset', 'seed', 'public_size', 'indices',
    'classes'}.

  Raises:
    ConfigError: the folder's public.json cannot be read, or holds another
      split.
  """
  split_path = os.path.join(workdir, 'public.json')
  split = {
    'dataset': dataset,
    'seed': seed,
    'public_size': public_size,
    'indices': public.tolist(),
    'classes': None if classes is None else list(classes),
  }
  if os.path.lexists(split_path):
    try:
      old = jsonfile.load(split_path, MAX_PUBLIC_BYTES)
    except jsonfile.JsonFileError as e:
      raise errors.ConfigError(
        f'`workdir={workdir}`: its public split {e} (the split of '
        'the pool trained there): use a new `workdir`'
      ) from None
    if (
      old.get('indices') != split['indices']
      or old.get('classes') != (split['classes'])
    ):
      raise errors.ConfigError(
        f'`workdir={workdir}` holds a pool trained on another public '
        'split (`dataset`, `public_size`, `seed` or `classes` differ): '
        'use a new `workdir`'
      )
  files.write_atomic(split_path, lambda f: json.dump(split, f))
  return split


def pretrain_and_save(
  workdir: str,
  name: str,
  model: models_lib.Model,
  dataset: Any,
  x: np.ndarray,
  y: np.ndarray,
  *,
  public_size: int,
  classes: Sequence[int] | None,
  epochs: int,
  batch_size: int,
  learning_rate: float,
  seed: int,
) -> dict[str, Any]:
  """Trains `model` (the zoo model `name`) on the public examples (`x`,
  `y`) of `dataset` (a `datasets.Dataset`; `pretrain`'s arguments), saves
  it in the pool folder `workdir` (`save_model`) and returns its metadata
  (`test_accuracy` on the dataset's test set, `train_loss` per epoch,
  `train_seconds`, ...)."""
  t0 = time.perf_counter()
  variables, losses = pretrain(
    model,
    x,
    y,
    scale=dataset.scale,
    shift=dataset.shift,
    epochs=epochs,
    batch_size=batch_size,
    learning_rate=learning_rate,
    seed=seed,
  )
  seconds = time.perf_counter() - t0
  acc = accuracy(
    model,
    variables,
    dataset.x_test,
    dataset.y_test,
    scale=dataset.scale,
    shift=dataset.shift,
  )
  meta = {
    'dataset': dataset.name,
    'public_size': public_size,
    'classes': classes,
    'epochs': epochs,
    'train_loss': losses,
    'test_accuracy': acc,
    'train_seconds': seconds,
  }
  save_model(workdir, name, model, variables, **meta)
  return meta


def pretrain(
  model: models_lib.Model,
  x: np.ndarray,
  y: np.ndarray,
  *,
  scale: float,
  shift: float,
  epochs: int,
  batch_size: int = 64,
  learning_rate: float = 1e-3,
  seed: int = 0,
) -> tuple[dict, list[float]]:
  """Trains a zoo model centrally with Adam (the pool's "pre-training").

  Args:
    model: the zoo model.
    x: `[M, ...]` stored examples.
    y: `[M]` labels.
    scale: model input is `x * scale + shift`.
    shift: see `scale`.
    epochs: passes over the data (shuffled each epoch; the last partial
      batch is dropped).
    batch_size: examples per step.
    learning_rate: Adam's.
    seed: initialisation, shuffling and dropout.

  Returns:
    (variables, mean training loss per epoch).
  """
  key = jax.random.key(seed)
  variables = model.init(key)
  tx = optax.adam(learning_rate)
  opt = tx.init(variables['params'])

  def loss_fn(params, rest, xb, yb, k):
    logits, state = model.apply_train({'params': params, **rest}, xb, k)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
    return loss, state

  # The pool is built once, outside any round: this is its own small loop.
  @jax.jit
  def step(variables, opt, xb, yb, k):
    params = variables['params']
    rest = {c: v for c, v in variables.items() if c != 'params'}
    xb = xb.astype(jnp.float32) * scale + shift
    (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      params, rest, xb, yb, k
    )
    updates, opt = tx.update(grads, opt, params)
    return {'params': optax.apply_updates(params, updates), **state}, opt, loss

  rng = np.random.default_rng(seed)
  n = len(x) // batch_size * batch_size
  if n == 0:
    raise errors.ConfigError(
      f'`batch_size={batch_size}` exceeds the {len(x)} public examples'
    )
  losses = []
  for epoch in range(epochs):
    perm = rng.permutation(len(x))[:n].reshape(-1, batch_size)
    total = 0.0
    for i, idx in enumerate(perm):
      k = jax.random.fold_in(jax.random.fold_in(key, epoch), i)
      variables, opt, loss = step(
        variables, opt, jnp.asarray(x[idx]), jnp.asarray(y[idx]), k
      )
      total += float(loss)
    losses.append(total / len(perm))
  return variables, losses


def accuracy(
  model: models_lib.Model,
  variables: dict,
  x: np.ndarray,
  y: np.ndarray,
  *,
  scale: float,
  shift: float,
  batch_size: int = 500,
) -> float:
  """Inference-mode accuracy of a pool model on stored examples."""
  fn = jax.jit(model.apply_eval)
  correct = 0
  for i in range(0, len(x), batch_size):
    xb = jnp.asarray(x[i : i + batch_size]).astype(jnp.float32) * scale + shift
    correct += int(
      np.sum(np.asarray(fn(variables, xb)).argmax(1) == y[i : i + batch_size])
    )
  return correct / max(len(x), 1)


def save_model(
  folder: str, model_id: str, model: models_lib.Model, variables: dict, **meta
) -> None:
  """Saves one pool model under `<folder>/<model_id>/`."""
  path = os.path.abspath(os.path.join(folder, model_id))
  os.makedirs(path, exist_ok=True)
  ckpt = os.path.join(path, 'variables')
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(ckpt, jax.tree.map(np.asarray, variables), force=True)
  checkpointer.wait_until_finished()
  info = {
    'model': model.name,
    'num_classes': model.num_classes,
    'input_shape': list(model.input_shape),
    **meta,
  }
  files.write_atomic(
    os.path.join(path, 'meta.json'), lambda f: json.dump(info, f, indent=1)
  )


# A pool model's meta.json is a few hundred bytes (its public split is in
# public.json); its bounds keep a damaged or hostile one from allocating.
MAX_META_BYTES = 1 << 20
MAX_PUBLIC_BYTES = 1 << 28  # 'indices': up to ~25 million examples
MAX_CLASSES = 1 << 20
MAX_INPUT_DIM = 1 << 16


def _pool_error(e: Exception) -> errors.DataError:
  return errors.DataError(f'`pool`: {e}')


def read_meta(folder: str, model_id: str) -> dict[str, Any]:
  """The checked meta.json of `<folder>/<model_id>/`: a JSON object with a
  zoo "model" name, "num_classes" (an integer ≥ 2), "input_shape" (a list
  of 1 to 3 positive integers) and optionally "classes" (a list of
  integers or null).

  Raises:
    DataError: no meta.json, or one that cannot be read or is malformed
      (one line naming `pool`, the file and the field).
  """
  path = os.path.abspath(os.path.join(folder, model_id))
  meta_path = os.path.join(path, 'meta.json')
  if not os.path.lexists(meta_path):
    raise errors.DataError(
      f'`pool`: {errors.clip(path)} has no meta.json (want {{"model", '
      '"num_classes", "input_shape"}} next to an orbax "variables" '
      'checkpoint)'
    )
  try:
    meta = jsonfile.load(meta_path, MAX_META_BYTES)
    name = jsonfile.field(meta, 'model', str, meta_path)
    if name not in models_lib.NAMES:
      raise jsonfile.JsonFileError(
        meta_path,
        f'"model" is {jsonfile.describe(name)}, not a zoo model (one of '
        f'{", ".join(models_lib.NAMES)})',
      )
    num_classes = jsonfile.field(meta, 'num_classes', int, meta_path)
    if not 2 <= num_classes <= MAX_CLASSES:
      raise jsonfile.JsonFileError(
        meta_path, f'"num_classes" is {num_classes}, not in [2, {MAX_CLASSES}]'
      )
    shape = jsonfile.field(meta, 'input_shape', list, meta_path)
    if not 1 <= len(shape) <= 3:
      raise jsonfile.JsonFileError(
        meta_path, f'"input_shape" has {len(shape)} entries, not 1 to 3'
      )
    for i, d in enumerate(shape):
      name_i = f'"input_shape"[{i}]'
      if not 1 <= jsonfile.check(d, int, meta_path, name_i) <= MAX_INPUT_DIM:
        raise jsonfile.JsonFileError(
          meta_path, f'{name_i} is {d}, not in [1, {MAX_INPUT_DIM}]'
        )
    classes = jsonfile.field(meta, 'classes', list, meta_path, default=None)
    for i, c in enumerate(classes or ()):
      jsonfile.check(c, int, meta_path, f'"classes"[{i}]')
  except jsonfile.JsonFileError as e:
    raise _pool_error(e) from None
  return meta


def load_model(folder: str, model_id: str) -> PoolModel:
  """Loads `<folder>/<model_id>/` (meta.json, checked by `read_meta`, and
  the orbax checkpoint `variables`).

  Raises:
    DataError: a missing or malformed meta.json, a model the meta.json
      does not describe, or a `variables` checkpoint that cannot be
      restored as its variables (one line naming `pool` and the file).
  """
  meta = read_meta(folder, model_id)
  path = os.path.abspath(os.path.join(folder, model_id))
  meta_path = os.path.join(path, 'meta.json')
  try:
    model = models_lib.get(
      meta['model'], meta['num_classes'], tuple(meta['input_shape'])
    )
  except errors.ConfigError as e:  # input_shape is not what it takes
    raise errors.DataError(
      f'`pool`: {meta_path}: "input_shape" {meta["input_shape"]} does not '
      f'fit "model" {meta["model"]}: {e}'
    ) from None
  ckpt = os.path.join(path, 'variables')
  if not os.path.isdir(ckpt):
    raise errors.DataError(
      f'`pool`: {errors.clip(ckpt)}: no such folder (want the orbax '
      'checkpoint of the variables beside meta.json)'
    )
  like = jax.eval_shape(model.init, jax.random.key(0))
  checkpointer = ocp.StandardCheckpointer()
  try:
    variables = checkpointer.restore(ckpt, like)
  except Exception as e:  # noqa: BLE001 - orbax raises many kinds
    first = str(e).splitlines()[0] if str(e) else ''
    raise errors.DataError(
      f'`pool`: {errors.clip(ckpt)}: cannot restore it as the variables of '
      f'a {meta["model"]} model ({type(e).__name__}: {errors.clip(first)})'
    ) from None
  return PoolModel(model_id, model, dict(variables), meta)


def model_ids(folder: str) -> list[str]:
  """The model ids (sub-folders with a meta.json) of a pool folder, sorted."""
  if not os.path.isdir(folder):
    raise errors.DataError(f'`pool`: {folder!r} is not a folder')
  ids = sorted(
    d
    for d in os.listdir(folder)
    if os.path.exists(os.path.join(folder, d, 'meta.json'))
  )
  if not ids:
    raise errors.DataError(
      f'`pool`: no models in {folder!r}; run `python -m '
      'experiments.pretrain_zoo` first'
    )
  return ids


def load(folder: str, ids: Sequence[str] | None = None) -> list[PoolModel]:
  """Loads the pool's models (all, or the given ids)."""
  return [load_model(folder, i) for i in (ids or model_ids(folder))]


def public_indices(folder: str) -> dict[str, Any] | None:
  """The saved public split (`public.json`: an object whose "indices" is a
  list of integers), or None.

  Raises:
    DataError: a public.json that cannot be read or is malformed.
  """
  path = os.path.join(folder, 'public.json')
  if not os.path.lexists(path):
    return None
  try:
    split = jsonfile.load(path, MAX_PUBLIC_BYTES)
    indices = jsonfile.field(split, 'indices', list, path)
    for i, index in enumerate(indices):
      if not 0 <= jsonfile.check(index, int, path, f'"indices"[{i}]') < 2**31:
        raise jsonfile.JsonFileError(
          path, f'"indices"[{i}] is {index}, not in [0, 2**31)'
        )
  except jsonfile.JsonFileError as e:
    raise _pool_error(e) from None
  return split


def chains(
  models: Sequence[PoolModel], cuts: str = 'default'
) -> list[tuple[blocks_lib.Block, ...]]:
  """Every pool model cut into blocks (see `blocks.split`)."""
  return [
    blocks_lib.split(
      m.id,
      m.model.name,
      m.variables,
      m.model.input_shape,
      cuts,
      module=m.model.module,
    )
    for m in models
  ]


class Pool(NamedTuple):
  """The block pool: every block of every pre-trained model.

  Attributes:
    blocks: all blocks; a block's position here is its pool id.
    models: model ids in order.
  """

  blocks: tuple[blocks_lib.Block, ...]
  models: tuple[str, ...]

  def ids_of(self, model: str) -> list[int]:
    return [i for i, b in enumerate(self.blocks) if b.model == model]

  def starts(self) -> list[int]:
    return [i for i, b in enumerate(self.blocks) if b.kind == 'start']


def make_pool(chains: Sequence[Sequence[blocks_lib.Block]]) -> Pool:
  """A pool from each pre-trained model's blocks (see `blocks.split`)."""
  models = [c[0].model for c in chains]
  if len(set(models)) != len(models):
    raise errors.ConfigError(f'pool model ids must be unique: {models}')
  specs = {tuple(c[0].in_spec) for c in chains}
  if len(specs) != 1:
    raise errors.ConfigError(
      f'pool models take different inputs {sorted(specs)}: all must take '
      "the dataset's examples"
    )
  return Pool(tuple(b for c in chains for b in c), tuple(models))
