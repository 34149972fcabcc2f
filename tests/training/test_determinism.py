"""A run is a pure function of (config, seed) on 2 host devices too.

With XLA:CPU's convolution gradient two host devices running at once
change each other's results in the last digits (BUILD.md,
"Reproducibility"); the default im2col gradient does not. These tests fail
with `layers.conv_implementation('conv')`: `G=conv python
scripts/xla_cpu_concurrency_repro.py` measured 8 of 8 concurrent results
differing from the sequential one, 0 of 8 with G=im2col (jaxlib 0.10.2).
"""

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import fedjax_mr as fm
from fedjax_mr.models import layers
from fedjax_mr.models import model as model_lib
from tests import helpers


def _bits(tree) -> np.ndarray:
  leaves = jax.tree.leaves(jax.device_get(tree))
  return np.concatenate([np.asarray(v).ravel() for v in leaves]).view(np.uint32)


@pytest.mark.slow
def test_concurrent_devices_give_the_sequential_bits():
  devices = jax.devices()
  assert len(devices) >= 2 and layers.conv_gradient() == 'im2col'
  model = model_lib.get('cnn_mnist', 10, (28, 28, 1))
  params = model.init(jax.random.key(0))['params']
  rng = np.random.default_rng(0)
  x = rng.standard_normal((500, 28, 28, 1)).astype(np.float32)
  y = rng.integers(0, 10, 500).astype(np.int32)

  def loss(p, xb, yb, key):
    logits, _ = model.apply_train(
      {'params': p}, xb, key, mask=jnp.ones(xb.shape[0])
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

  @jax.jit
  def train(p, x, y):
    def step(j, p):
      i = (j % 10) * 50
      xb = lax.dynamic_slice_in_dim(x, i, 50)
      yb = lax.dynamic_slice_in_dim(y, i, 50)
      grads = jax.grad(loss)(p, xb, yb, jax.random.key(j))
      return jax.tree.map(lambda a, g: a - 0.05 * g, p, grads)

    return lax.fori_loop(0, 400, step, p)

  on = [[jax.device_put(t, d) for t in (params, x, y)] for d in devices[:2]]
  reference = _bits(train(*on[0]))
  a, b = train(*on[0]), train(*on[1])  # both dispatched, then waited for
  np.testing.assert_array_equal(_bits(a), reference)
  np.testing.assert_array_equal(_bits(b), reference)


def test_the_note_names_the_backends_that_cannot_promise_bits(monkeypatch):
  from fedjax_mr.training import experiment

  assert experiment.reproducibility_note('cpu', 2) is None
  assert experiment.reproducibility_note('cpu', 1) is None
  with layers.conv_implementation('conv'):
    assert experiment.reproducibility_note('cpu', 2) == (
      experiment.CPU_DEVICES_NOTE
    )
    assert experiment.reproducibility_note('cpu', 1) is None
  # GPUs: deterministic only when XLA is told to be.
  monkeypatch.setenv('XLA_FLAGS', '--xla_gpu_autotune_level=0')
  assert experiment.reproducibility_note('gpu', 1) == experiment.GPU_NOTE
  monkeypatch.setenv('XLA_FLAGS', '--xla_gpu_deterministic_ops=true')
  assert experiment.reproducibility_note('gpu', 1) is None
  assert experiment.reproducibility_note('tpu', 4) is None


def test_fresh_processes_on_two_devices_give_the_same_bits(
  small_fmnist_dir, tmp_path
):
  runs = []
  for i in range(3):
    work = tmp_path / f'run{i}'
    proc = helpers.run_module(
      'experiments.run',
      f'--data_dir={small_fmnist_dir}',
      '--num_clients=10',
      '--clients_per_round=4',
      '--alpha=0.5',
      '--local_epochs=3',
      '--rounds=2',
      '--eval_every=1',
      '--host_devices=2',
      '--num_devices=2',
      f'--workdir={work}',
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '2 cpu device(s)' in proc.stdout
    rows = [json.loads(line) for line in open(work / 'metrics.jsonl')]
    rows = [{k: v for k, v in r.items() if not k.endswith('_s')} for r in rows]
    digest = hashlib.sha256(_bits(fm.load_run(str(work)).state).tobytes())
    runs.append((rows, digest.hexdigest()))
  assert len(runs[0][0]) == 2 and 'test_loss' in runs[0][0][-1]
  assert runs[1] == runs[0] and runs[2] == runs[0]
