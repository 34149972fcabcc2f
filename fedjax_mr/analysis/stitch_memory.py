"""The FedStitch paper's Fig. 5: the client memory of one round, measured
from the blocks each method trains or evaluates (JAX, jitted), its table
and figure.

References: "Heterogeneity-Aware Coordination for Federated Learning via
Stitching Pre-trained blocks", Shichen Zhan, Yebo Wu, Chunlin Tian, Yan
Zhao, Li Li (2024).
"""

from __future__ import annotations

from typing import Any
from typing import Mapping
from typing import Sequence

import numpy as np

from fedjax_mr.analysis import stitch_tables
from fedjax_mr.runtime import plots

# --- Client memory in one round (Fig. 5) -----------------------------------


def _nbytes(tree: Any) -> int:
  import jax

  return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)))


def block_memory(block: Any, batch_size: int) -> dict[str, Any]:
  """Measured memory of one block's inference forward pass at
  `batch_size` (`budgets.step_memory_bytes`): its variables, the input
  batch, its output and temporaries."""
  import jax
  import jax.numpy as jnp

  from fedjax_mr.stitch import blocks as blocks_lib
  from fedjax_mr.training import budgets

  x = jax.ShapeDtypeStruct((batch_size, *block.in_spec), jnp.float32)
  variables = jax.tree.map(
    lambda v: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype),
    block.variables,
  )
  forward = budgets.step_memory_bytes(
    lambda v, x: blocks_lib.run_steps(block.steps, v, x), variables, x
  )
  params = _nbytes(block.variables)
  return {
    'block': block.describe(),
    'model': block.model,
    'forward_bytes': forward,
    'parameter_bytes': params,
    'working_bytes': max(forward - params, 0),
  }


def memory_data(
  chains: Sequence[Sequence[Any]],
  pool_models: Sequence[Any],
  baselines: Sequence[tuple[str, Any]],
  batch_size: int,
  train_batch_size: int,
  ft_layers: int = 2,
) -> dict[str, Any]:
  """Fig. 5's bars, in bytes.

  FedStitch: a client holds the pool's blocks and scores candidates one
  forward pass at a time, so its memory in a round is every block's
  parameters plus the largest working memory (input, output and
  temporaries) of one block's forward pass at `batch_size`; 'FedStitch
  (one block)': the largest forward pass alone (parameters, input, output
  and temporaries of one block), as if blocks were loaded one at a time.
  FT-Full and FT-Part of each pool model, and every baseline trained from
  scratch:
  one SGD step at `train_batch_size` (`budgets.training_memory_bytes`),
  at the model's own input shape.

  Args:
    chains: the pool models cut into blocks (`pool.chains`).
    pool_models: the `PoolModel`s of `chains` (for FT-Full / FT-Part).
    baselines: (label, zoo `Model`) trained from scratch.
    batch_size: FedStitch's scoring batch.
    train_batch_size: the baselines' local batch.
    ft_layers: FT-Part trains the last this many parameterised modules
      (`fedjax_mr.algorithms.finetune.final_modules`, as experiments.run
      does with `algorithm=ft_part` and `ft_layers`).
  """
  from fedjax_mr.algorithms import finetune

  blocks = [block_memory(b, batch_size) for chain in chains for b in chain]
  bars = {}
  if blocks:
    held = sum(b['parameter_bytes'] for b in blocks)
    bars['FedStitch'] = held + max(b['working_bytes'] for b in blocks)
    # Without the pool held: the largest single forward pass.
    bars['FedStitch (one block)'] = max(b['forward_bytes'] for b in blocks)
  for m in pool_models:
    bars[f'FT-Full {m.id}'] = finetune.training_memory(
      m.model, None, train_batch_size, None
    )
    bars[f'FT-Part {m.id}'] = finetune.training_memory(
      m.model,
      finetune.final_modules(m.model, ft_layers),
      train_batch_size,
      None,
    )
  for label, model in baselines:
    bars[label] = finetune.training_memory(model, None, train_batch_size, None)
  return {
    'batch_size': batch_size,
    'train_batch_size': train_batch_size,
    'bars_bytes': bars,
    'blocks': blocks,
  }


def memory_table(data: Mapping[str, Any]) -> str:
  bars = data['bars_bytes']
  ref = bars.get('FedStitch')
  rows = [
    [
      name,
      f'{b / 2**20:.2f}',
      ''
      if ref is None or name.startswith('FedStitch')
      else f'{100 * (1 - ref / b):.1f}',
    ]
    for name, b in bars.items()
  ]
  return stitch_tables.markdown(
    ['method', 'client memory (MiB)', 'FedStitch saves (%)'], rows
  )


def memory_figure(data: Mapping[str, Any]) -> Any:
  """Fig. 5: one bar per method, client memory in one round (MiB)."""
  figure, canvas = plots._matplotlib()
  bars = data['bars_bytes']
  fig = figure(
    figsize=(min(0.8 * len(bars) + 3, 14), 4.4), layout='constrained'
  )
  canvas(fig)
  ax = fig.subplots()
  names = list(bars)
  colors = plots._colors(len(names))
  drawn = ax.bar(
    range(len(names)), [bars[n] / 2**20 for n in names], color=colors
  )
  ax.bar_label(drawn, fmt='%.1f', fontsize='x-small')
  ax.set_xticks(range(len(names)), names, rotation=30, ha='right')
  ax.set_ylabel('client memory in one round (MiB)')
  ax.grid(alpha=0.3, axis='y')
  fig.suptitle(
    f'FedStitch: forward passes at batch {data["batch_size"]}; baselines: '
    f'one SGD step at batch {data["train_batch_size"]}',
    fontsize='medium',
  )
  return fig
