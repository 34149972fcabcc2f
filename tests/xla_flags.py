"""The XLA flags the suite compiles with, beyond a program's.

Most of the suite's time is XLA:CPU compiling small rounds. Three flags make
that cheaper without changing what a program means:

- LLVM at -O0 (`--xla_backend_optimization_level=0`): about a quarter less
  compile time (the suite's heaviest tests: 393 s against 478 s on 2 loaded
  Intel cores); a run that learns on real data executes a little slower.
- XLA:CPU's older fusion emitters (`--xla_cpu_use_fusion_emitters=false`)
  in place of the MLIR ones: the contract round of every registered
  algorithm compiles in about 40 % of the time (tests/pipeline/
  test_registry.py: 156 s of CPU against 281 s, AMD EPYC, 2 cores), and
  the small rounds execute no slower. But where XLA's default emitters
  give two different programs of one computation the same bits (FedProx
  at mu = 0 and FedAvg, ASAM at rho = 0 and SGD), the older ones fuse each
  program its own way and round in another order: the tests of such an
  identity compile both programs with a program's emitters
  (`PROGRAM_EMITTERS`, through `helpers.program_jit`).

- One LLVM module per program (`--xla_cpu_parallel_codegen_split_count=1`,
  XLA splits it in 32 to compile the parts on threads): the suite's
  workers already keep both cores busy, so the split only costs
  (tests/pipeline/test_registry.py alone, beside another of the same:
  60.9 s of CPU against 56.1 s, AMD EPYC). The same code, the same
  bits (`machine_numerics` and every regression recording unchanged).

XLA's own passes stay as they are, but some kernels round differently
(`machine_numerics` changes), so every comparison in the suite is between
runs compiled alike: the programs the tests start inherit the flags, and
the regression recordings keep an entry per kind of machine under them
(tests/pipeline/test_regression.py). A program that mostly executes
(the concurrency reproducer of tests/pipeline/test_determinism.py, which
compares runs inside one process) gets a program's flags back
(`program_flags`).

No imports: tests/conftest.py reads this before JAX starts.
"""

COMPILE_FLAGS = (
  '--xla_backend_optimization_level=0',
  '--xla_cpu_use_fusion_emitters=false',
  '--xla_cpu_parallel_codegen_split_count=1',
)

# Per jitted function (`jax.jit(..., compiler_options=...)`): the fusion
# emitters a program compiles with.
PROGRAM_EMITTERS = {'xla_cpu_use_fusion_emitters': True}


def program_flags(xla_flags: str) -> str:
  """`xla_flags` (an XLA_FLAGS value) without `COMPILE_FLAGS`: what a
  program the suite starts compiles with when it runs long enough that
  executing, not compiling, is most of its time (at -O0 the rounds run
  at about 2.5 times a program's time)."""
  names = {f.split('=', 1)[0] for f in COMPILE_FLAGS}
  return ' '.join(
    f for f in xla_flags.split() if f.split('=', 1)[0] not in names
  )
