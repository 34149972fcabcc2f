"""A training run reads its partition file (`partition=file`) once: the
digest, the checks and the build share what `checks.check` read."""

import json

import pytest
from absl import flags

from fedjax_mr.data import partition
from tests.data import test_idx_and_datasets as idx_tests


@pytest.fixture
def counted_reads(monkeypatch):
  """The paths `partition.read_file` (the one reader) is called with."""
  paths = []
  read = partition.read_file

  def counting(path):
    paths.append(path)
    return read(path)

  monkeypatch.setattr(partition, 'read_file', counting)
  return paths


@pytest.mark.slow
def test_one_run_of_the_program_reads_the_file_once(tmp_path, counted_reads):
  from experiments import cli
  from experiments import run

  data = idx_tests.idx_folder(tmp_path / 'data')
  path = tmp_path / 'split.json'
  path.write_text(json.dumps([[2 * k, 2 * k + 1] for k in range(10)]))
  argv = [
    f'--data_dir={data}',
    '--partition=file',
    f'--partition_file={path}',
    '--num_clients=10',
    '--clients_per_round=2',
    '--rounds=1',
    '--local_epochs=1',
    f'--workdir={tmp_path / "run"}',
  ]
  try:
    run.main(cli.parse_flags(['experiments.run', *argv]))
  finally:
    flags.FLAGS.unparse_flags()
  assert (tmp_path / 'run' / 'config.json').exists()
  assert counted_reads == [str(path)]
