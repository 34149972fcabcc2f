import shutil
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

peak = [0]


def rss():
  for line in open('/proc/self/status'):
    if line.startswith('VmRSS'):
      return int(line.split()[1]) // 1024


def samp():
  while True:
    peak[0] = max(peak[0], rss())
    time.sleep(0.005)


threading.Thread(target=samp, daemon=True).start()
cbs = int(sys.argv[1]) if len(sys.argv) > 1 else None
a = np.ones((1000000, 60, 10), np.float32)
state = {
  'clients': {'kernel': a, 'bias': np.zeros((1000000, 10), np.float32)},
  'server': jax.numpy.ones((610,)),
}
print('before', rss(), flush=True)
shutil.rmtree('/tmp/mem/ck', ignore_errors=True)
m = ocp.CheckpointManager(
  '/tmp/mem/ck',
  options=ocp.CheckpointManagerOptions(
    max_to_keep=2, create=True, enable_async_checkpointing=False
  ),
)
sa = jax.tree.map(lambda x: ocp.SaveArgs(chunk_byte_size=cbs), state)
time.sleep(0.05)
peak[0] = 0
time.sleep(0.05)
peak[0] = 0
t = time.time()
m.save(1, args=ocp.args.StandardSave(state, save_args=sa), force=True)
m.wait_until_finished()
time.sleep(0.05)
print(
  'save peak', peak[0], 'after', rss(), f'{time.time() - t:.1f}s', flush=True
)
like = jax.tree.map(
  lambda x: (
    np.broadcast_to(np.zeros(x.shape[1:], x.dtype), x.shape)
    if x.ndim > 1
    else x
  ),
  state,
)
del state, a
time.sleep(0.2)
print('dropped', rss())
time.sleep(0.05)
peak[0] = 0
time.sleep(0.05)
peak[0] = 0
t = time.time()
abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
r = m.restore(1, args=ocp.args.StandardRestore(abstract))
time.sleep(0.05)
print(
  'restore peak',
  peak[0],
  'after',
  rss(),
  f'{time.time() - t:.1f}s',
  type(r['clients']['kernel']),
  r['clients']['kernel'].flags['C_CONTIGUOUS'],
  flush=True,
)
