r"""Benchmarks a federated round against the hardware limit.

  python -m experiments.benchmark                 # default setting
  python -m experiments.benchmark --matrix        # devices × sizes
  python -m experiments.benchmark --num_clients=10000 --clients_per_round=1000
  python -m experiments.benchmark --algorithm=scaffold   # against FedAvg
  python -m experiments.benchmark --dataset=synthetic --model=logistic \
    --num_clients=1000000 --clients_per_round=10000 --local_epochs=1

For one setting it prints: compile time; steady-state seconds per round
(median over --rounds after a warm-up, `block_until_ready`); the *limit* —
centralised training of the same model on the same number of sample-steps
and batch size, as one jitted loop in this process with the same fast
layers; the ratio round/limit; samples/s; achieved GFLOP/s; the server-side
share of a round; the evaluation share (the model a run evaluates, and
for FedMR-type algorithms the K models it dispatches next, on the whole
test set as `experiments.run` evaluates them, once per --eval_every
rounds, as a fraction of those rounds' time); peak memory; and, with
PyTorch installed (the `bench`
extra), the round time of a plain PyTorch FedAvg loop on the same clients
(`experiments.torch_reference`: same model, batches, epochs and step
counts, --threads threads). Every timed round is followed by the limit at
exactly that round's number of steps (with Dirichlet sizes every round runs
a different number) and by the PyTorch round, and with several device
settings the rounds of each setting alternate, so ratios and speed-ups
compare runs made seconds apart. Then the float32 and bfloat16 matmul peak
of device 0 (large jitted products, measured in the same process) and the
first setting's fraction of the float32 peak; the first setting's
per-client overhead, `per-client overhead: X ms/client (Y% of the
round)`: what a round costs beyond its limit, (round − limit) / K, and
that as a share of the round (both the median over the timed rounds,
each round against the limit timed right after it). The last lines are
`evaluation share: X.X%`, `round/pytorch ratio: X.XX` (with PyTorch) and
`round/limit ratio: X.XX` for the first setting.

`--dataset=synthetic` (with `--model=logistic`) benchmarks at scale:
Synthetic(α, β) (`fedjax_mr.data.synthetic`; `--synthetic_alpha`,
`--synthetic_beta`, seed 0), N clients generated on demand with their own
lognormal sizes (the size setting is `lognormal`; `--sizes` and `--alpha`
do not apply) and their held-out test set, as `experiments.run` builds
them. A round generates each batch's examples as its local step asks for
them, so its limit does too: the same number of steps of batch B, each
generating B fresh examples of one client (client 0, positions following
on from a random start) with `SyntheticData.batch`, the round's
generator. The limit thus pays the per-example cost of generation (a
normal draw per feature, the labelling model's product) and, once, that
client's parameters; it leaves out what the round pays per client: the
sampling of K of N, dispatch and the sum, drawing each client's
parameters (W_k, b_k, v_k: 672 normals, XLA hoists them out of the step
loop, so once per client), the per-epoch permutation (uniform draws and
an argsort over the largest client size) and each client's loop and
optimizer setup. That is the per-client overhead. There is no PyTorch
loop for generated clients.

`--algorithm` times another algorithm of the registry (its hyper-parameter
flags as in `experiments.run`) on the same clients, and FedAvg beside it on
the first device setting, round for round; it then also prints
`round/fedavg ratio: X.XX`, the median ratio of the two algorithms' time
per local step (equal to the ratio of round times when both train the same
clients; clustered sampling draws its own). The limit and the PyTorch loop
stay FedAvg's work on the algorithm's clients: what the algorithm's extra
computation costs shows in those ratios too.

For the prepared GPU call (`scripts/gpu_check.sh`): `--random_data` times
on random images of the dataset's shape; `--sizes=range` draws client
sizes from `--min_client_size..--max_client_size`; `--client_chunks`
times several `--client_chunk` settings round by round in one process;
`--limit_batch` makes the limit the round's samples trained centrally in
batches of that size; `--compute_dtype` and `--matmul_precision` set the
precision of both sides; every setting's line ends with the SHA-256 of
its final server state.
"""

from __future__ import annotations

# First: Ctrl-C while the modules below import ends in one line (cli).
from . import cli  # isort: split

import functools
import math
import os
import resource
import statistics
import time

from absl import flags

flags.DEFINE_string('dataset', 'fashion_mnist', 'Dataset.')
flags.DEFINE_string('data_dir', '', 'Dataset folder (see experiments.run).')
flags.DEFINE_string('model', 'cnn_mnist', 'Model.')
flags.DEFINE_integer('num_clients', 100, 'Clients N.')
flags.DEFINE_integer('clients_per_round', 10, 'Clients per round K.')
flags.DEFINE_integer('local_epochs', 5, 'Local epochs E.')
flags.DEFINE_integer('batch_size', 50, 'Batch size B.')
flags.DEFINE_enum(
  'sizes',
  'equal',
  ['equal', 'dirichlet', 'range'],
  'Client sizes: equal shares, Dirichlet(--alpha) label skew, or sizes drawn '
  'uniformly from --min_client_size..--max_client_size.',
)
flags.DEFINE_integer('min_client_size', 10, 'Smallest client (--sizes=range).')
flags.DEFINE_integer('max_client_size', 50, 'Largest client (--sizes=range).')
flags.DEFINE_bool(
  'random_data',
  False,
  "Random uint8 images and labels of the dataset's shape and classes "
  'instead of the stored set (timing where the data cannot be read).',
)
flags.DEFINE_integer(
  'random_train_size',
  0,
  'Training examples of --random_data (0: 50,000, or N × '
  '--max_client_size for --sizes=range); the test set holds at most 10,000.',
)
flags.DEFINE_enum(
  'compute_dtype',
  'float32',
  ['float32', 'bfloat16'],
  'The model computes in this dtype; bfloat16 keeps float32 master '
  'weights (fedjax_mr.models.model.get). The PyTorch loop autocasts alike.',
)
flags.DEFINE_enum(
  'matmul_precision',
  'default',
  ['default', 'highest'],
  "float32 products: JAX's default precision (TF32 on NVIDIA GPUs; the "
  'PyTorch loop then allows TF32 too) or highest (full float32 on both '
  'sides).',
)
flags.DEFINE_integer(
  'limit_batch',
  0,
  "The limit's batch (0: B, the round's steps). Else the limit trains the "
  "round's samples in ceil(samples / this) steps of this batch (K × B: "
  'the same samples trained centrally by one model).',
)
flags.DEFINE_bool(
  'peak',
  True,
  "Measure the device's float32 and bfloat16 matmul peak at the end.",
)
flags.DEFINE_list(
  'client_chunks',
  [],
  'Several --client_chunk settings (e.g. 1,5,10: sequential, chunks, all '
  'vmapped) timed round by round in one process, beside each device setting.',
)
flags.DEFINE_float('alpha', 0.1, 'Dirichlet α for --sizes=dirichlet.')
flags.DEFINE_integer(
  'num_devices',
  1,
  'Devices the client axis is sharded over (0: every device; as '
  'experiments.run).',
)
flags.DEFINE_integer(
  'client_chunk',
  0,
  '0: 1 on CPU (8 for models of at most 1,000 parameters), all on '
  'accelerators up to 1,000 a device.',
)
flags.DEFINE_integer('host_devices', 0, 'XLA host devices (0: auto).')
flags.DEFINE_integer('rounds', 5, 'Timed rounds (after one warm-up).')
flags.DEFINE_bool(
  'matrix', False, '1 and all devices × equal and Dirichlet sizes.'
)
flags.DEFINE_bool(
  'pytorch',
  True,
  'Also time a plain PyTorch FedAvg loop on the same clients '
  '(experiments.torch_reference; needs the bench extra, skipped without it).',
)
flags.DEFINE_bool(
  'limit',
  True,
  'Time the limit (centralised training of the same steps, one jitted '
  'loop); off for large K on accelerators, where it is sequential.',
)
flags.DEFINE_integer(
  'threads',
  0,
  'PyTorch intra-op threads on the CPU (0: all cores; at most the cores).',
)
flags.DEFINE_string(
  'algorithm', 'fedavg', 'Algorithm to time (a name of the registry).'
)
flags.DEFINE_integer(
  'eval_every',
  10,
  'Evaluation share: one evaluation (as experiments.run with '
  '--eval_every and, for FedMR-type algorithms, --local_eval_every) per '
  'this many rounds.',
)
flags.DEFINE_integer(
  'eval_batch_size', 500, 'Test batch size (as experiments.run).'
)


def _define_dataset_flags() -> list[str]:
  """The flags of the config fields that only some datasets read
  (Synthetic's α and β), with the help of `experiments.run`'s. Returns
  their names."""
  from fedjax_mr.harness import config as config_lib

  names = []
  for f in config_lib.base_fields():
    if f.name in config_lib.DATASET_FIELDS:
      cli.define_flag(f.name, f, f.metadata['help'])
      names.append(f.name)
  return names


DATASET_FLAGS = _define_dataset_flags()
ALGORITHM_FLAGS = cli.define_algorithm_flags()
FLAGS = flags.FLAGS


def _block(x):
  import jax

  return jax.block_until_ready(x)


def _synthetic() -> bool:
  """Whether the clients are generated (`--dataset=synthetic`)."""
  from fedjax_mr.data import datasets

  return FLAGS.dataset == datasets.SYNTHETIC


def _size_kinds() -> tuple[str, ...]:
  """The client-size settings: equal and Dirichlet shares of a stored
  dataset, or the generated clients' own lognormal sizes."""
  return ('lognormal',) if _synthetic() else ('equal', 'dirichlet', 'range')


def _setup(sizes):
  """The model, its optimizer and initial variables, the clients of each
  size setting of `sizes` (`{setting: ClientData or SyntheticData}`), the
  test set `(x, y, scale, shift)`, what the PyTorch loop reads (`(dataset,
  {setting: partition})`, None for generated clients) and the timed
  algorithms."""
  import jax
  import optax

  from fedjax_mr.models import model as model_lib

  options = cli.algorithm_options(ALGORITHM_FLAGS)
  if _synthetic():
    data, test_set, num_classes, input_shape = _generated_clients(options)
    stored = None
  else:
    ds, parts, data = _stored_clients(sizes)
    test_set = (ds.x_test, ds.y_test, ds.scale, ds.shift)
    num_classes, input_shape = ds.num_classes, ds.input_shape
    stored = (ds, parts)
  base = model_lib.get(
    FLAGS.model, num_classes, input_shape, compute_dtype=FLAGS.compute_dtype
  )
  opt = optax.sgd(0.01, momentum=0.9)
  variables = base.init(jax.random.key(0))
  # The requested algorithm with its flags; FedAvg beside it with none.
  algorithms = {FLAGS.algorithm: _algorithm(FLAGS.algorithm, base, options)}
  if FLAGS.algorithm != 'fedavg':
    algorithms['fedavg'] = _algorithm('fedavg', base, {})
  return base, opt, variables, data, test_set, stored, algorithms


def _stored_clients(sizes):
  """`(dataset, {setting: partition}, {setting: ClientData})` of a stored
  dataset split over N clients, for each size setting of `sizes`."""
  from fedjax_mr.data import client_data
  from fedjax_mr.data import datasets
  from fedjax_mr.data import partition

  n = FLAGS.num_clients
  if FLAGS.random_data:
    m = FLAGS.random_train_size or (
      n * FLAGS.max_client_size if 'range' in sizes else 50_000
    )
    ds = datasets.random_images(FLAGS.dataset, m, min(m, 10_000))
  else:
    ds = datasets.load(FLAGS.dataset, FLAGS.data_dir or None)
  # The papers' minimum of 10 examples per client, relaxed when N is so
  # large that the average client holds fewer than 20.
  min_size = max(1, min(10, len(ds.y_train) // (2 * n)))
  make = {
    'equal': lambda: partition.iid(len(ds.y_train), n, 0),
    'dirichlet': lambda: partition.dirichlet(
      ds.y_train, n, FLAGS.alpha, 0, min_size=min_size
    ),
    'range': lambda: partition.sizes_between(
      len(ds.y_train), n, FLAGS.min_client_size, FLAGS.max_client_size, 0
    ),
  }
  parts = {k: make[k]() for k in sizes}
  data = {
    k: client_data.from_partition(ds.x_train, ds.y_train, p, ds.scale, ds.shift)
    for k, p in parts.items()
  }
  return ds, parts, data


def _generated_clients(options):
  """`({'lognormal': SyntheticData}, test set, classes, input shape)`:
  Synthetic(α, β)'s N clients and held-out test set as `experiments.run`
  builds them (`build.load_clients`, `options`: the algorithm's flags)."""
  from fedjax_mr.harness import build

  clients = build.load_clients(_config(FLAGS.algorithm, options))
  test_set = (clients.x_test, clients.y_test, clients.scale, clients.shift)
  return (
    {'lognormal': clients.data},
    test_set,
    clients.num_classes,
    clients.input_shape,
  )


def _algorithm(name, base, options):
  """`(algorithm, its model's initial variables)` for registry entry
  `name`, with hyper-parameter flags `options` and the benchmark's
  setting."""
  import jax

  from fedjax_mr.harness import build
  from fedjax_mr.harness import config as config_lib
  from fedjax_mr.harness import registry

  config = _config(name, options)
  config_lib.validate(config)
  model = registry.model_for(name, base, config_lib.hparams(config))
  variables = model.init(jax.random.key(0))
  algorithm = build.build_algorithm(config, model, variables)
  return algorithm, variables, model, config_lib.multi_model(config)


def _config(name, options):
  """The experiment config of the benchmark's setting for algorithm
  `name` (its hyper-parameter flags `options`)."""
  from fedjax_mr.harness import config as config_lib

  return config_lib.ExperimentConfig(
    algorithm=name,
    dataset=FLAGS.dataset,
    model=FLAGS.model,
    num_clients=FLAGS.num_clients,
    clients_per_round=FLAGS.clients_per_round,
    local_epochs=FLAGS.local_epochs,
    batch_size=FLAGS.batch_size,
    lr=0.01,
    momentum=0.9,
    **{name: FLAGS[name].value for name in DATASET_FLAGS},
    **options,
  )


def _limit_fn(model, opt, variables, data, b, flops_batch):
  """Centralised SGD as one jitted loop with the same layers.

  Returns:
    `(run, flops)`: `run(steps, key)` trains `steps` steps of batch `b`
    from a random start on what `_limit_batches` reads and blocks until
    done; `flops` is XLA's cost analysis of one step of batch
    `flops_batch` (a round's).
  """
  import jax
  import jax.numpy as jnp
  import optax
  from jax import lax

  inputs, batch, m = _limit_batches(data, b)
  # BatchNorm's running statistics (resnet20's): read as the clients read
  # them; their update is not part of the limit's work.
  rest = {k: v for k, v in variables.items() if k != 'params'}

  def loss_fn(params, x, y):
    logits, _ = model.apply_train(
      {**rest, 'params': params}, x, jax.random.key(0)
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  grad_fn = jax.grad(loss_fn)

  def train_step(params, opt_state, x, y):
    g = grad_fn(params, x, y)
    updates, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def train(params, inputs, start, steps):
    def step(i, carry):
      params, opt_state = carry
      return train_step(params, opt_state, *batch(inputs, start + i * b))

    # A run-time step count, like the clients' exact step counts.
    return lax.fori_loop(0, steps, step, (params, opt.init(params)))[0]

  fn = jax.jit(train)
  params = variables['params']

  def run(steps, key):
    start = jax.random.randint(key, (), 0, m)
    _block(fn(params, inputs, start, jnp.int32(steps)))

  x = jnp.zeros((flops_batch, *model.input_shape), jnp.float32)
  y = jnp.zeros((flops_batch,), jnp.int32)
  cost = (
    jax.jit(train_step)
    .lower(params, opt.init(params), x, y)
    .compile()
    .cost_analysis()
  )
  if isinstance(cost, list):
    cost = cost[0]
  flops = float(cost.get('flops', 0.0)) if cost else 0.0
  return run, flops


def _limit_batches(data, b):
  """What the limit trains on, read the fastest way.

  Stored clients (`ClientData`): their whole training set, shuffled once
  outside the timing and read in contiguous batches (the step's offset
  wrapped around). Generated clients (`SyntheticData`): client 0's
  examples at the `b` positions from the step's offset on, generated as
  the round generates every batch (`SyntheticData.batch`; its parameters
  are loop-invariant, drawn once).

  Returns:
    `(inputs, batch, m)`: the arrays the jitted loop takes,
    `batch(inputs, offset) -> (x [b, ...] normalised, y [b])` and the
    range `[0, m)` of a random start.
  """
  import jax
  import jax.numpy as jnp
  from jax import lax

  from fedjax_mr.data import client_data

  if _synthetic():
    # Positions up to m + steps × b stay far below 2**31.
    return data, lambda d, at: d.batch(jnp.int32(0), at + jnp.arange(b)), 2**20
  m = data.x.shape[0]

  def batch(inputs, offset):
    x_all, y_all = inputs
    at = offset % (m - b + 1)
    x = lax.dynamic_slice_in_dim(x_all, at, b)
    x = client_data.normalize(x, data.scale, data.shift)
    return x, lax.dynamic_slice_in_dim(y_all, at, b)

  # The fastest input pipeline: the dataset shuffled once, outside the
  # timing, and read in contiguous batches.
  perm = jax.random.permutation(jax.random.key(0), m)
  return _block((data.x[perm], data.y[perm])), batch, m


def _peak_gflops(dtype_name):
  """GFLOP/s of a large square matmul in `dtype_name` on device 0, jitted,
  default precision (as the models compute): the machine's arithmetic peak
  as this process can reach it."""
  import jax
  import jax.numpy as jnp

  gpu = jax.devices()[0].platform != 'cpu'
  n = 8192 if gpu else 2048
  dtype = jnp.dtype(dtype_name)
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
  f = jax.jit(lambda a, b: a @ b)
  _block(f(a, b))
  reps = 20 if gpu else 5
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    _block(f(a, b))
    times.append(time.perf_counter() - t)
  return 2 * n**3 / statistics.median(times) / 1e9


def _torch_loop(ds, parts, sizes, variables):
  """The plain PyTorch loop on the same data, or None without PyTorch."""
  import jax

  try:
    from . import torch_reference
  except ImportError:
    return None
  if FLAGS.model not in torch_reference.MODELS:
    return None
  gpu = jax.devices()[0].platform != 'cpu'
  loop = torch_reference.FedAvgLoop(
    FLAGS.model,
    ds.x_train,
    ds.y_train,
    parts[sizes],
    ds.scale,
    ds.shift,
    ds.num_classes,
    FLAGS.local_epochs,
    FLAGS.batch_size,
    0.01,
    0.9,
    'cuda' if gpu else 'cpu',
    FLAGS.threads or os.cpu_count(),
    FLAGS.compute_dtype,
  )
  # JAX's default float32 products use TF32 on NVIDIA GPUs: the same here.
  print(torch_reference.set_tf32(FLAGS.matmul_precision == 'default'))
  ours = sum(v.size for v in jax.tree.leaves(variables['params']))
  theirs = torch_reference.num_parameters(loop.model)
  if ours != theirs:
    raise RuntimeError(
      f'the PyTorch {FLAGS.model} has {theirs} parameters, ours {ours}'
    )
  return loop


def _no_torch_line():
  """Why there is no PyTorch round: not installed, or no such model."""
  try:
    from . import torch_reference
  except ImportError:
    return 'PyTorch reference: not installed (pip install -e .[bench])'
  return (
    f'PyTorch reference: none for {FLAGS.model} (it has '
    f'{", ".join(torch_reference.MODELS)})'
  )


def _prepare(
  setting,
  devices,
  data,
  test_set,
  name,
  algorithm,
  variables,
  model,
  multi,
  client_chunk=None,
  like=None,
):
  """Compiles one setting's round and evaluation; times its server-side
  work alone. `client_chunk`: as --client_chunk (None: that flag); `like`:
  a prepared run of the same devices and algorithm whose server time and
  compiled evaluation this one reuses (neither depends on the chunk)."""
  import jax
  import numpy as np

  from fedjax_mr.core import tree
  from fedjax_mr.harness import distributed
  from fedjax_mr.training import engine

  k = FLAGS.clients_per_round
  d = len(jax.devices()) if devices == 'all' else int(devices)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:d]), ('clients',))
  chunk = distributed.client_mapping(
    k,
    FLAGS.client_chunk if client_chunk is None else client_chunk,
    mesh,
    tree.num_parameters(variables['params']),
  )['client_chunk']
  # As experiments.run: per-client state in host memory.
  state = engine.init_state(
    algorithm, variables, data.num_clients, host_clients=True
  )
  key = jax.random.key(1)
  t = time.perf_counter()
  step = _compiled_round(algorithm, state, data, key, chunk, mesh, d)
  compile_s = time.perf_counter() - t
  if like is None:
    server_s = _server_seconds(algorithm, state, data, key)
    evaluate, test_examples = _evaluation(
      algorithm, model, multi, data, test_set, key, d, mesh if d > 1 else None
    )
    # Compiled at its first (warm-up) call: FedAvg timed beside another
    # algorithm is never evaluated.
    evaluate = jax.jit(evaluate)
  else:
    server_s, evaluate = like['server_s'], like['evaluate']
    test_examples = like['test_examples']
  return {
    'name': name,
    'setting': setting,
    'devices': d,
    'chunk': chunk,
    'compile_s': compile_s,
    'server_s': server_s,
    'step': lambda s: step(s, data, key),
    'evaluate': evaluate,
    'evaluated': 1 + k * multi,
    'test_examples': test_examples,
    'state': state,
    'times': [],
    'steps': [],
    'examples': [],
    'limits': [],
    'balance': [],
  }


def _compiled_round(algorithm, state, data, key, chunk, mesh, d):
  """`step(state, data, key) -> (state, metrics)`, compiled as
  experiments.run compiles it (without donation): one jitted round, or
  for per-client state in host memory the jitted sampler and the round
  on the sampled rows (`host_round.make_host_round`)."""
  import jax
  import numpy as np

  from fedjax_mr.training import engine
  from fedjax_mr.training import host_round

  k = FLAGS.clients_per_round
  make = functools.partial(
    engine.make_round_fn,
    algorithm,
    clients_per_round=k,
    client_chunk=chunk,
    mesh=mesh if d > 1 else None,
  )
  if not engine.has_clients(state):
    return jax.jit(make()).lower(state, data, key).compile()
  sample = jax.jit(engine.make_sample_fn(algorithm, k))
  device_state = state.replace(clients=())
  ids = sample(device_state, data, key)
  rows = jax.tree.map(lambda a: a[np.asarray(ids)], state.clients)
  rows_round = (
    jax.jit(make(client_rows=True))
    .lower(device_state, data, key, ids, rows)
    .compile()
  )
  return host_round.make_host_round(sample, rows_round)


def _server_seconds(algorithm, state, data, key):
  """Seconds of the server-side work of a round alone: sampling (when the
  algorithm has its own sampler), dispatch and aggregate on stand-in
  uploads of the right layout (the client update's output for K clients,
  as ones, or their sums for an algorithm that needs only sums); the mean
  of 10 after a warm-up."""
  import jax
  import jax.numpy as jnp

  from fedjax_mr.core import types

  k = FLAGS.clients_per_round
  ids = jnp.arange(k, dtype=jnp.int32)
  one_client = jax.tree.map(lambda x: x[0], state.clients)
  sent = jax.eval_shape(algorithm.dispatch, state.server, ids, state.round, key)
  per_client = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), sent.per_client
  )
  upload = jax.eval_shape(
    algorithm.client_update,
    sent.shared,
    per_client,
    one_client,
    data,
    ids[0],
    key,
  )[0]
  if algorithm.contribution is None:
    outputs = jax.tree.map(lambda s: jnp.ones((k, *s.shape), s.dtype), upload)
  else:
    # The server sees only the sums (the clients add as they finish).
    total = jax.eval_shape(algorithm.contribution, upload)
    outputs = types.Sums(
      jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), total),
      *(jnp.ones((k,), s.dtype) for s in upload[1:4]),
    )

  def server_only(st, out):
    if algorithm.sampler is not None:
      algorithm.sampler(key, st.round, st.server, data)
    inputs = algorithm.dispatch(st.server, ids, st.round, key)
    new, _ = algorithm.aggregate(st.server, out, ids, st.round, key)
    return new, inputs

  srv = jax.jit(server_only)
  _block(srv(state, outputs))
  t = time.perf_counter()
  for _ in range(10):
    _block(srv(state, outputs))
  return (time.perf_counter() - t) / 10


def _evaluation(algorithm, model, multi, data, test_set, key, d, mesh):
  """What experiments.run evaluates: the algorithm's model and, for
  multi-model algorithms, the K models the next round dispatches, with the
  test batches split over the same `d` devices (`mesh`, None for one).

  Returns:
    `(evaluate, test examples)`: `evaluate(state)` (not jitted) gives the
    evaluations.
  """
  from fedjax_mr.core import types
  from fedjax_mr.data import client_data
  from fedjax_mr.training import engine
  from fedjax_mr.training import evaluation

  k = FLAGS.clients_per_round
  x_test, y_test, scale, shift = test_set
  test = client_data.eval_data(
    x_test, y_test, FLAGS.eval_batch_size, scale, shift, num_shards=d
  )
  evaluate_model = evaluation.make_evaluate(model, mesh)
  evaluate_many = evaluation.make_evaluate_dispatched(model, algorithm, mesh)

  def evaluate(st):
    out = {
      'model': evaluate_model(types.evaluated_model(algorithm, st.server), test)
    }
    if multi:
      sent = engine.next_dispatch(algorithm, st, data, key, k)
      out['models'] = evaluate_many(sent, test)
    return out

  return evaluate, len(y_test)


def _bench_sizes(
  sizes, devs, model, opt, variables, data, test_set, algorithms, loop
):
  """Times the settings of one client-size kind, interleaved.

  After one warm-up round each, every timed round runs once per device
  setting (the same clients: same key, same round index), followed by the
  limit at exactly that round's number of steps and, with `torch_loop`, a
  plain PyTorch FedAvg round on the same clients (checked to take the
  same number of steps). Each round/limit ratio and
  each device speed-up is taken between runs seconds apart, so drifts in
  the machine's speed (large on shared 2-core machines) cancel.
  """
  torch_loop = loop
  name = FLAGS.algorithm
  chunks = [int(c) for c in FLAGS.client_chunks] or [None]
  runs = []
  for dev in devs:
    first = None
    for chunk in chunks:
      runs.append(
        _prepare(
          sizes, dev, data, test_set, name, *algorithms[name], chunk, first
        )
      )
      first = first or runs[-1]
  # FedAvg beside another algorithm, on the first device setting.
  baseline = None
  if name != 'fedavg':
    baseline = _prepare(
      sizes, devs[0], data, test_set, 'fedavg', *algorithms['fedavg']
    )
  b = min(FLAGS.batch_size, int(data.max_size))
  lb = FLAGS.limit_batch or b
  if FLAGS.limit_batch and not _synthetic() and lb > data.x.shape[0]:
    cli.fail(
      f'--limit_batch={lb} exceeds the {data.x.shape[0]} training examples'
    )
  limit, flops = _limit_fn(model, opt, variables, data, lb, b)
  for r in ([baseline] if baseline else []) + runs:  # warm-up
    r['state'], m = r['step'](r['state'])
    _block(r['state'])
  if FLAGS.limit:
    limit(_limit_steps(m), _key(0))
  if torch_loop is not None:
    torch_loop.round(m['client_ids'].tolist())  # warm-up
  torch_times = []
  for i in range(FLAGS.rounds):
    pt_s = _timed_round(i, runs, baseline, limit, torch_loop, data, b)
    if pt_s is not None:
      torch_times.append(pt_s)
  _time_evaluation(runs)
  return [
    _figures(r, flops, torch_times, baseline if r is runs[0] else None)
    for r in runs
  ]


def _timed_round(i, runs, baseline, limit, torch_loop, data, b):
  """Timed round `i`: once per device setting, then FedAvg beside another
  algorithm, the limit at that round's steps and the PyTorch round (whose
  seconds it returns; None without PyTorch). Appends to the runs'
  records."""
  for r in runs:
    t = time.perf_counter()
    r['state'], m = r['step'](r['state'])
    _block(r['state'])
    r['times'].append(time.perf_counter() - t)
    r['steps'].append(int(m['num_steps']))
    r['examples'].append(int(m['num_examples']) * FLAGS.local_epochs)
    r['balance'].append(_balance(data, m['client_ids'], b, r['devices']))
  if baseline is not None:
    t = time.perf_counter()
    baseline['state'], mb = baseline['step'](baseline['state'])
    _block(baseline['state'])
    baseline['times'].append(time.perf_counter() - t)
    baseline['steps'].append(int(mb['num_steps']))
  steps = {r['steps'][-1] for r in runs}
  if len(steps) != 1:
    raise RuntimeError(f'device settings ran different steps: {steps}')
  t = time.perf_counter()
  if FLAGS.limit:
    limit(_limit_steps(m), _key(i + 1))
  lim = time.perf_counter() - t if FLAGS.limit else math.nan
  for r in runs:
    r['limits'].append(lim)
  if torch_loop is None:
    return None
  pt_s, pt_steps = torch_loop.round(m['client_ids'].tolist())
  if pt_steps != runs[-1]['steps'][-1]:
    raise RuntimeError(
      f'PyTorch took {pt_steps} steps, fedjax_mr {runs[-1]["steps"][-1]}'
    )
  return pt_s


def _limit_steps(metrics):
  """The limit's steps for a round of `metrics`: the round's, or with
  --limit_batch its samples (examples × E) in batches of that size."""
  if not FLAGS.limit_batch:
    return int(metrics['num_steps'])
  samples = int(metrics['num_examples']) * FLAGS.local_epochs
  return -(-samples // FLAGS.limit_batch)


def _time_evaluation(runs):
  """Each run's evaluation seconds, timed after the rounds (one warm-up,
  then the median of 3), as `eval_s`."""
  for r in runs:
    _block(r['evaluate'](r['state']))
    evals = []
    for _ in range(3):
      t = time.perf_counter()
      _block(r['evaluate'](r['state']))
      evals.append(time.perf_counter() - t)
    r['eval_s'] = statistics.median(evals)


def _figures(r, flops, torch_times, baseline):
  """The figures of run `r`: medians over its timed rounds; ratios to the
  PyTorch rounds `torch_times` (if any) and to FedAvg's `baseline` run
  (None: not compared)."""
  times, steps = r['times'], r['steps']
  round_s = statistics.median(times)
  return {
    'setting': r['setting'],
    'devices': r['devices'],
    'chunk': r['chunk'],
    'compile_s': r['compile_s'],
    'round_s': round_s,
    'times': times,
    'steps': statistics.median(steps),
    'limit_s': statistics.median(r['limits']),
    'ratio': statistics.median([t / lim for t, lim in zip(times, r['limits'])]),
    'overhead_s': statistics.median(
      [t - lim for t, lim in zip(times, r['limits'])]
    ),
    'overhead_pct': statistics.median(
      [100 * (t - lim) / t for t, lim in zip(times, r['limits'])]
    ),
    'samples_per_s': statistics.median(
      [e / t for e, t in zip(r['examples'], times)]
    ),
    'gflops': statistics.median(
      [flops * st / t / 1e9 for st, t in zip(steps, times)]
    ),
    'server_pct': 100 * r['server_s'] / round_s,
    'eval_s': r['eval_s'],
    'evaluated': r['evaluated'],
    'test_examples': r['test_examples'],
    'eval_pct': 100 * r['eval_s'] / (FLAGS.eval_every * round_s),
    'balance': statistics.median(r['balance']),
    'pytorch_s': statistics.median(torch_times) if torch_times else None,
    'pytorch_ratio': statistics.median(
      [t / p for t, p in zip(times, torch_times)]
    )
    if torch_times
    else None,
    'fedavg_ratio': statistics.median(
      (t / st) / (tb / sb)
      for t, st, tb, sb in zip(
        times, steps, baseline['times'], baseline['steps']
      )
    )
    if baseline is not None
    else None,
    'fedavg_s': statistics.median(baseline['times'])
    if baseline is not None
    else None,
    'state_sha256': _state_sha256(r['state']),
  }


def _state_sha256(state):
  """SHA-256 of the server state's bytes (leaf by leaf, in tree order): two
  runs that trained alike give the same."""
  import hashlib

  import jax
  import numpy as np

  h = hashlib.sha256()
  for leaf in jax.tree.leaves(state.server):
    if jax.dtypes.issubdtype(getattr(leaf, 'dtype', None), jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    h.update(np.asarray(leaf).tobytes())
  return h.hexdigest()


def _balance(data, client_ids, b, d):
  """Mean over max of the devices' local steps as the engine deals them.

  A client never splits across devices, so `d` devices can be at most
  `d × balance` times faster than one.
  """
  import numpy as np

  from fedjax_mr.training import placement

  sizes = np.asarray(data.sizes)[np.asarray(client_ids)]
  steps = -(-sizes // b)
  perm = np.asarray(placement.balanced_order(sizes, d))
  per_device = steps[perm].reshape(d, -1).sum(axis=1)
  return float(per_device.mean() / per_device.max())


def _key(i):
  import jax

  return jax.random.key(i)


def _memory_line():
  import jax

  peak_host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  line = f'peak host memory: {peak_host:.0f} MiB'
  stats = jax.devices()[0].memory_stats() or {}
  if 'peak_bytes_in_use' in stats:
    peak = stats['peak_bytes_in_use'] / 2**20
    line += f'; peak device memory: {peak:.0f} MiB'
  return line


def _check_flags():
  """One line naming the first bad flag (before any JAX work)."""
  for name in (
    'num_clients',
    'clients_per_round',
    'local_epochs',
    'batch_size',
    'rounds',
  ):
    if FLAGS[name].value < 1:
      cli.fail(f'--{name} must be ≥ 1, got {FLAGS[name].value}')
  for name in ('eval_every', 'eval_batch_size'):
    if FLAGS[name].value < 1:
      cli.fail(f'--{name} must be ≥ 1, got {FLAGS[name].value}')
  for name in ('client_chunk', 'host_devices', 'threads'):
    if FLAGS[name].value < 0:
      cli.fail(f'--{name} must be ≥ 0, got {FLAGS[name].value}')
  # More intra-op threads than cores only time-slice them (1,000,000 made
  # PyTorch crash with a segmentation fault).
  cores = os.cpu_count() or 1
  if FLAGS.threads > cores:
    cli.fail(
      f"--threads must be at most {cores} (this machine's cores; 0: all), "
      f'got {FLAGS.threads}'
    )
  if not 1 <= FLAGS.min_client_size <= FLAGS.max_client_size:
    cli.fail(
      '--min_client_size and --max_client_size need 1 ≤ min ≤ max, got '
      f'{FLAGS.min_client_size} and {FLAGS.max_client_size}'
    )
  for name in ('random_train_size', 'limit_batch'):
    if FLAGS[name].value < 0:
      cli.fail(f'--{name} must be ≥ 0, got {FLAGS[name].value}')
  for c in FLAGS.client_chunks:
    if not c.isdigit():
      cli.fail(f'--client_chunks takes counts ≥ 0, got {c!r}')
  if FLAGS.random_data and _synthetic():
    cli.fail('--random_data stands in for a stored dataset, not synthetic')
  if FLAGS.clients_per_round > FLAGS.num_clients:
    cli.fail(
      f'--clients_per_round={FLAGS.clients_per_round} exceeds '
      f'--num_clients={FLAGS.num_clients}'
    )
  if not (FLAGS.alpha > 0 and math.isfinite(FLAGS.alpha)):
    cli.fail(f'--alpha must be finite and > 0, got {FLAGS.alpha}')
  if FLAGS.num_devices < 0:
    cli.fail(f'--num_devices must be ≥ 0, got {FLAGS.num_devices}')
  from fedjax_mr.core import errors
  from fedjax_mr.harness import config as config_lib

  try:
    config = _config(FLAGS.algorithm, cli.algorithm_options(ALGORITHM_FLAGS))
    config_lib.validate(config)
    config_lib.hparams(config)
  except errors.UserError as e:
    cli.fail(str(e))
  for name in ('sizes', 'alpha'):
    if _synthetic() and FLAGS[name].present:
      cli.fail(
        f'--{name} sets the shares of a stored dataset; --dataset=synthetic '
        'clients have their own lognormal sizes'
      )


def _settings(k, n_dev):
  """The (sizes, devices) settings to time, from --matrix, --sizes and
  --num_devices; refuses more devices than K or than there are."""
  if FLAGS.matrix:
    kinds = [s for s in _size_kinds() if s != 'range']
    runs = [(sizes, dev) for sizes in kinds for dev in ('1', 'all')]
  else:
    sizes = _size_kinds()[0] if _synthetic() else FLAGS.sizes
    runs = [(sizes, str(FLAGS.num_devices or 'all'))]
  for sizes, dev in runs:
    d = n_dev if dev == 'all' else int(dev)
    if d > min(n_dev, k):
      cli.fail(
        f'--num_devices={d}: need at most K={k} and at most the {n_dev} devices'
      )
  return runs


def _setting_line(r):
  """One setting's figures as one line."""
  return (
    f'[{r["setting"]}, {r["devices"]} device(s), chunk {r["chunk"]}] '
    f'compile {r["compile_s"]:.2f}s | round {r["round_s"]:.3f}s '
    f'({r["steps"]:.0f} steps) | '
    + (
      f'limit {r["limit_s"]:.3f}s | round/limit {r["ratio"]:.3f} '
      f"({1 / r['ratio']:.3f} of the limit's samples/s) | "
      if FLAGS.limit
      else 'limit not timed | '
    )
    + f'{r["samples_per_s"]:.0f} samples/s '
    f'| {r["gflops"]:.1f} GFLOP/s | server {r["server_pct"]:.3f}% of '
    f'round | evaluation {r["eval_s"]:.3f}s ({r["evaluated"]} '
    f'model(s), {r["test_examples"]} test examples), '
    f'{r["eval_pct"]:.1f}% of {FLAGS.eval_every} rounds'
    + (
      f' | pytorch {r["pytorch_s"]:.3f}s, round/pytorch '
      f'{r["pytorch_ratio"]:.3f}'
      if r['pytorch_s'] is not None
      else ''
    )
    + (
      f' | fedavg {r["fedavg_s"]:.3f}s, per-step ratio {r["fedavg_ratio"]:.3f}'
      if r['fedavg_ratio'] is not None
      else ''
    )
    + f' | state sha256 {r["state_sha256"][:16]}'
  )


def _bench(runs, model, opt, variables, data, test_set, stored, algorithms):
  """Times every setting of `runs`, size kind by size kind, printing one
  line per setting; returns their figures in that order. `stored`: the
  dataset and partitions the PyTorch loop reads, None for generated
  clients (no PyTorch loop)."""
  results = []
  if FLAGS.pytorch and stored is None:
    print('PyTorch reference: none for generated clients (--dataset=synthetic)')
  for sizes in _size_kinds():
    devs = [dev for s, dev in runs if s == sizes]
    if not devs:
      continue
    loop = None
    if FLAGS.pytorch and stored is not None:
      loop = _torch_loop(*stored, sizes, variables)
      if loop is None and sizes == runs[0][0]:
        print(_no_torch_line())
    for r in _bench_sizes(
      sizes,
      devs,
      model,
      opt,
      variables,
      data[sizes],
      test_set,
      algorithms,
      loop,
    ):
      results.append(r)
      print(_setting_line(r))
  return results


def _print_summary(results, n_dev):
  """The lines after the settings': device speed-ups, memory, the matmul
  peaks (measured now) and the first setting's shares and ratios."""
  by = {(r['setting'], r['devices']): r for r in results}
  for sizes in _size_kinds():
    if (sizes, 1) in by and (sizes, n_dev) in by and n_dev > 1:
      # Round by round: each pair ran seconds apart on the same clients.
      speedup = statistics.median(
        t1 / tn
        for t1, tn in zip(by[(sizes, 1)]['times'], by[(sizes, n_dev)]['times'])
      )
      bound = n_dev * by[(sizes, n_dev)]['balance']
      print(
        f'{sizes}: {n_dev} devices are {speedup:.2f}x faster than 1 '
        f'(clients dealt to devices allow at most {bound:.2f}x)'
      )
  print(_memory_line())
  first = results[0]
  if FLAGS.peak:
    peak32 = _peak_gflops('float32')
    peak16 = _peak_gflops('bfloat16')
    print(
      f'matmul peak: float32 {peak32:.1f} GFLOP/s, bfloat16 {peak16:.1f} '
      f'GFLOP/s (default precision, device 0); the first setting reaches '
      f'{100 * first["gflops"] / peak32:.1f}% of the float32 peak'
    )
  print(_overhead_line(first))
  print(
    f'evaluation share: {first["eval_pct"]:.1f}% (once per '
    f'{FLAGS.eval_every} rounds)'
  )
  if first['fedavg_ratio'] is not None:
    print(f'round/fedavg ratio: {first["fedavg_ratio"]:.2f}')
  if first['pytorch_ratio'] is not None:
    print(f'round/pytorch ratio: {first["pytorch_ratio"]:.2f}')
  if FLAGS.limit:
    print(f'round/limit ratio: {first["ratio"]:.2f}')


def _overhead_line(r):
  """Run `r`'s per-client overhead: what its round costs beyond the limit,
  per client and as a share of the round."""
  if not FLAGS.limit:
    return 'per-client overhead: not measured (--nolimit)'
  per_client_ms = 1e3 * r['overhead_s'] / FLAGS.clients_per_round
  return (
    f'per-client overhead: {per_client_ms:.3g} ms/client '
    f'({r["overhead_pct"]:.1f}% of the round)'
  )


def _clients_line(data):
  """What the generated clients are (`--dataset=synthetic`)."""
  import numpy as np

  sizes = np.asarray(data.sizes)
  return (
    f'Synthetic({FLAGS.synthetic_alpha:g}, {FLAGS.synthetic_beta:g}): '
    f'{len(sizes)} clients generated on demand, mean size '
    f'{sizes.mean():.2f}, at most {sizes.max()}; the limit generates its '
    'examples too (client 0, one batch a step)'
  )


def main(argv):
  cli.no_arguments(argv)
  _check_flags()
  from fedjax_mr.core import errors
  from fedjax_mr.harness import distributed

  k = FLAGS.clients_per_round
  distributed.initialize(host_devices=FLAGS.host_devices, clients_per_round=k)
  import jax

  if FLAGS.matmul_precision != 'default':
    jax.config.update('jax_default_matmul_precision', FLAGS.matmul_precision)

  n_dev = len(jax.devices())
  runs = _settings(k, n_dev)
  try:
    model, opt, variables, data, test_set, stored, algorithms = _setup(
      {s for s, _ in runs}
    )
  except errors.UserError as e:
    cli.fail(str(e))
  print(
    f'{FLAGS.algorithm}, {FLAGS.model} on {FLAGS.dataset}: K={k} of '
    f'N={FLAGS.num_clients}, E={FLAGS.local_epochs}, B={FLAGS.batch_size}; '
    f'{n_dev} {jax.devices()[0].platform} device(s), {FLAGS.rounds} timed '
    f'rounds; compute {FLAGS.compute_dtype}, matmul precision '
    f'{FLAGS.matmul_precision}' + (', random data' if FLAGS.random_data else '')
  )
  if stored is None:
    print(_clients_line(data['lognormal']))
  results = _bench(
    runs, model, opt, variables, data, test_set, stored, algorithms
  )
  _print_summary(results, n_dev)


def entry() -> None:
  """The console script `fedjax-mr-benchmark`."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  cli.run(main)


if __name__ == '__main__':
  entry()
