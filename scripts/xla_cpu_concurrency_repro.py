"""Two XLA:CPU host devices running at once change each other's results.

The same jitted SGD loop (cnn_mnist, a fixed synthetic batch) is placed on
host device 0 and on device 1. Run one after the other, both give the same
bits every time; launched together (both dispatched before either is
waited for), one or both differ from that reference in the last digits,
which the steps then grow. This is the source of the run-to-run
differences of 2-device CPU runs (docs/howto/resume.md, "Reproducibility").

  .venv/bin/python scripts/xla_cpu_concurrency_repro.py           # S=400
  S=40 N=20 .venv/bin/python scripts/xla_cpu_concurrency_repro.py

Measured with jaxlib 0.10.2 on 2 cores: with 400 steps 8 of 8 concurrent
results differed; with 40 steps 0 of 20.
"""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=2')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

from fedjax_mr.models import layers  # noqa: E402
from fedjax_mr.models import model as model_lib  # noqa: E402

STEPS = int(os.environ.get('S', '400'))
REPEATS = int(os.environ.get('N', '4'))
# The convolution gradient (fedjax_mr.models.layers.conv_implementation):
# 'conv' differs under concurrency, 'im2col' (the CPU default) does not.
GRADIENT = os.environ.get('G', 'conv')


def main() -> None:
  devices = jax.devices()
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
    def step(j, carry):
      p, total = carry
      i = (j % 10) * 50
      xb = lax.dynamic_slice_in_dim(x, i, 50)
      yb = lax.dynamic_slice_in_dim(y, i, 50)
      value, grads = jax.value_and_grad(loss)(p, xb, yb, jax.random.key(j))
      return jax.tree.map(lambda a, g: a - 0.05 * g, p, grads), total + value

    return lax.fori_loop(0, STEPS, step, (p, 0.0))

  on = [[jax.device_put(t, d) for t in (params, x, y)] for d in devices[:2]]

  def bits(tree):
    leaves = jax.tree.leaves(jax.device_get(tree))
    return np.concatenate([np.asarray(v).ravel() for v in leaves]).view(
      np.uint32
    )

  reference = bits(train(*on[0]))
  assert np.array_equal(reference, bits(train(*on[1]))), 'sequential differs'
  differ = 0
  for _ in range(REPEATS):
    a, b = train(*on[0]), train(*on[1])  # both dispatched, then waited for
    jax.block_until_ready((a, b))
    differ += (not np.array_equal(bits(a), reference)) + (
      not np.array_equal(bits(b), reference)
    )
  print(
    f'{GRADIENT} gradient, {STEPS} steps: {differ} of {2 * REPEATS} '
    'concurrent results differ from the sequential one'
  )


if __name__ == '__main__':
  with layers.conv_implementation(GRADIENT):  # every trace uses it
    main()
