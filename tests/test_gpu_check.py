"""scripts/gpu_check.sh, the prepared device call, end to end on the CPU
in its tiny mode: items filed as they finish, the budget respected."""

import csv
import os
import subprocess
import tarfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, 'scripts', 'gpu_check.sh')

# The items in priority order, as the tiny mode numbers them.
TINY_ITEMS = [
  '01_papers_cnn_cifar',
  '02_papers_resnet20',
  '03_papers_vgg16',
  '04_cohort_cnn_mnist_K4',
  '05_cohort_cnn_mnist_K8',
  '06_cohort_cnn_mnist_K16',
  '07_cohort_resnet20_K4',
  '08_cohort_resnet20_K8',
  '09_cohort_resnet20_K16',
  '10_precision_highest_resnet20',
  '11_precision_bf16_resnet20',
  '12_determinism_cnn_cifar',
  '13_fedmr_K4',
  '14_fedmut_K4',
]

pytestmark = pytest.mark.slow


def _run(out, **env):
  env = {**os.environ, 'OUT': str(out), 'DET_MODEL': 'cnn_cifar', **env}
  return subprocess.run(
    ['bash', SCRIPT, '--tiny'],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=1500,
  )


def _summary(out):
  with open(out / 'summary.tsv', newline='') as f:
    rows = list(csv.reader(f, delimiter='\t'))
  assert rows[0] == ['item', 'rc', 'seconds', 'line']
  return rows[1:]


def test_tiny_mode_files_each_item_as_it_ends(tmp_path):
  # Two of the 14 items (about 40 s here); the determinism item (its three
  # runs about 50 s) and the others run the same driver with other flags.
  items = ['papers_cnn_cifar', 'cohort_cnn_mnist_K4']
  proc = _run(tmp_path, ITEMS=' '.join(items))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  header = (tmp_path / 'header.txt').read_text()
  assert 'commit: ' in header and 'experiments.benchmark imports' in header
  assert 'jax 0.' in header and 'jax devices: [CpuDevice' in header

  rows = _summary(tmp_path)
  names = ['01_papers_cnn_cifar', '04_cohort_cnn_mnist_K4']
  assert sorted({r[0] for r in rows}) == names
  assert {r[1] for r in rows} == {'0'}
  lines = {n: [r[3] for r in rows if r[0] == n] for n in names}
  # The papers' setting: sequential and all vmapped in one process, each
  # against the PyTorch loop where PyTorch is installed.
  papers = lines['01_papers_cnn_cifar']
  assert any(s.startswith('[equal, 1 device(s), chunk 1]') for s in papers)
  assert any(s.startswith('[equal, 1 device(s), chunk 2]') for s in papers)
  assert any(s.startswith('round/limit ratio: ') for s in papers)
  try:
    import torch  # noqa: F401
  except ImportError:
    pass
  else:
    assert any(s.startswith('round/pytorch ratio: ') for s in papers)
    assert any(
      s.startswith('PyTorch TF32: matmul.allow_tf32=True') for s in papers
    )
  # A large cohort against the same samples trained centrally.
  (cohort,) = [s for s in lines['04_cohort_cnn_mnist_K4'] if s[0] == '[']
  assert cohort.startswith('[range, 1 device(s)')
  assert "of the limit's samples/s" in cohort

  with tarfile.open(tmp_path / 'items.tar.gz') as tar:
    members = sorted(os.path.basename(m) for m in tar.getnames())
    assert members == [f'{n}.txt' for n in names]
    text = tar.extractfile('./01_papers_cnn_cifar.txt').read().decode()
  assert text.startswith('## 01_papers_cnn_cifar: bench --dataset=cifar10')
  assert 'random data' in text
  assert not (tmp_path / 'current.txt').exists()
  assert '== done in ' in proc.stdout


def test_items_past_the_budget_are_skipped_in_order(tmp_path):
  proc = _run(tmp_path, BUDGET='0')
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = _summary(tmp_path)
  assert [r[0] for r in rows] == TINY_ITEMS
  assert {r[1] for r in rows} == {'skipped'}
  assert not (tmp_path / 'items.tar.gz').exists()
