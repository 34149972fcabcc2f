"""Whether the next round's gather overlaps the round: the seconds until a
prefetching round's `step` returns (it has dispatched the round, then
gathered and put the next round's view) against the seconds until the
round's metrics are ready, on the papers' default setting with the
training set in host memory (BUILD.md "Scale: the training set on the
host").

  PYTHONPATH=. python docs/results/scale/prefetch/overlap.py
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import measure  # noqa: E402
from fedjax_mr.harness import distributed  # noqa: E402
from fedjax_mr.harness import experiment  # noqa: E402


def main():
  import jax

  config = measure.default_config(
    rounds=3, data_placement='host', prefetch=True, tensorboard=False
  )
  distributed.initialize_for(config)
  ex = experiment.setup(config)
  mapping = distributed.client_mapping(
    config.clients_per_round, config.client_chunk, ex.mesh
  )
  step = experiment._compile_round(ex, mapping['client_chunk'])
  state = ex.state
  for r in range(config.rounds):
    t0 = time.perf_counter()
    state, metrics = step(state, ex.data, ex.key)
    returned = time.perf_counter() - t0
    jax.block_until_ready(metrics)
    done = time.perf_counter() - t0
    row = {'round': r + 1, 'step_returns_s': returned, 'round_done_s': done}
    print(json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)


if __name__ == '__main__':
  main()
