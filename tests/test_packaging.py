"""The package as `pip install .` gives it: the library, the programs as
`fedjax_mr.experiments` with their console scripts and flagfiles, and no
top-level `experiments` package."""

import configparser
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject():
  with open(os.path.join(ROOT, 'pyproject.toml'), 'rb') as f:
    return tomllib.load(f)


def test_every_package_of_the_tree_is_listed():
  listed = set(_pyproject()['tool']['setuptools']['packages'])
  found = {
    os.path.relpath(root, ROOT).replace(os.sep, '.')
    for root, _, names in os.walk(os.path.join(ROOT, 'fedjax_mr'))
    if '__init__.py' in names
  }
  found |= {'fedjax_mr.experiments', 'fedjax_mr.experiments.configs'}
  assert listed == found
  assert not any(p.split('.')[0] == 'experiments' for p in listed)


def test_every_program_has_its_console_script():
  scripts = _pyproject()['project']['scripts']
  programs = {
    name[: -len('.py')]
    for name in os.listdir(os.path.join(ROOT, 'experiments'))
    if name.endswith('.py')
    and 'def entry()' in open(os.path.join(ROOT, 'experiments', name)).read()
  }
  assert programs >= {'run', 'compare', 'stitch', 'benchmark'}
  assert scripts == {
    f'fedjax-mr-{p.replace("_", "-")}': f'fedjax_mr.experiments.{p}:entry'
    for p in programs
  }


@pytest.fixture(scope='module')
def installed(tmp_path_factory):
  """The wheel built from a copy of the source tree, installed (without
  its dependencies, which this environment has) into a folder of its own."""
  tmp = tmp_path_factory.mktemp('wheel')
  files = subprocess.run(
    ['git', 'ls-files', '-co', '--exclude-standard'],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.split()
  source = tmp / 'source'
  for name in files:
    if name.startswith(('runs/', 'tests/')) or not os.path.isfile(
      os.path.join(ROOT, name)
    ):
      continue
    os.makedirs(source / os.path.dirname(name), exist_ok=True)
    shutil.copy(os.path.join(ROOT, name), source / name)
  pip = [sys.executable, '-m', 'pip', '--disable-pip-version-check', '-q']
  subprocess.run(
    [*pip, 'wheel', '--no-deps', '--no-build-isolation', '-w', tmp, source],
    check=True,
    capture_output=True,
  )
  (wheel,) = tmp.glob('fedjax_mr-*.whl')
  site = tmp / 'site'
  subprocess.run(
    [*pip, 'install', '--no-deps', '--target', site, wheel],
    check=True,
    capture_output=True,
  )
  return wheel, site


def test_the_wheel_holds_the_library_programs_and_configs(installed):
  wheel, _ = installed
  names = zipfile.ZipFile(wheel).namelist()
  tops = {n.split('/')[0] for n in names}
  assert {t for t in tops if not t.endswith('.dist-info')} == {'fedjax_mr'}
  configs = sorted(
    n for n in names if n.startswith('fedjax_mr/experiments/configs/')
  )
  assert [os.path.basename(n) for n in configs] == sorted(
    os.listdir(os.path.join(ROOT, 'experiments', 'configs'))
  )
  assert 'fedjax_mr/experiments/run.py' in names
  (entry_points,) = [n for n in names if n.endswith('entry_points.txt')]
  parser = configparser.ConfigParser()
  parser.read_string(zipfile.ZipFile(wheel).read(entry_points).decode())
  assert dict(parser['console_scripts']) == _pyproject()['project']['scripts']


def test_the_installed_program_runs_a_bundled_config_from_elsewhere(
  installed, small_fmnist_dir, tmp_path
):
  _, site = installed
  env = {
    **os.environ,
    'PYTHONPATH': str(site),  # before the editable checkout
    'TF_CPP_MIN_LOG_LEVEL': '2',
  }
  where = subprocess.run(
    [
      sys.executable,
      '-c',
      'import importlib.util as u, fedjax_mr; print(fedjax_mr.__file__); '
      "print(u.find_spec('experiments'))",
    ],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.split('\n')
  assert where[0].startswith(str(site)) and where[1] == 'None'
  work = tmp_path / 'run'
  proc = subprocess.run(
    [
      site / 'bin' / 'fedjax-mr-run',
      # A bundled config by name; it names default.flags in turn.
      '--flagfile=fmnist_table',
      f'--data_dir={small_fmnist_dir}',
      '--num_clients=6',
      '--clients_per_round=2',
      '--local_epochs=1',
      '--rounds=1',
      '--num_devices=1',
      '--host_devices=1',
      f'--workdir={work}',
    ],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
  )
  assert proc.returncode == 0, proc.stderr
  assert 'round 1/1' in proc.stdout
  config = open(work / 'config.json').read()
  assert '"rounds": 1' in config and '"algorithm": "fedavg"' in config


def test_the_installed_programs_print_their_help_from_elsewhere(
  installed, tmp_path
):
  _, site = installed
  env = {**os.environ, 'PYTHONPATH': str(site), 'TF_CPP_MIN_LOG_LEVEL': '2'}

  def helps(script, flag):
    proc = subprocess.run(
      [site / 'bin' / script, flag],
      cwd=tmp_path,
      env=env,
      capture_output=True,
      text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout

  for script, start, own in [
    ('fedjax-mr-run', 'Runs one federated training experiment.', 'rounds=20'),
    ('fedjax-mr-compare', 'Runs several algorithm variants', 'variants='),
    ('fedjax-mr-stitch', 'FedStitch on a dataset with a pool', 'pool='),
  ]:
    out = helps(script, '--helpshort')
    # The program's description and its flags by concern, its usage lines
    # and the other programs under their scripts' names (absl gave
    # `USAGE: .../fedjax-mr-run [flags]` and exit code 1).
    assert out.startswith(start), out
    assert f'\n  --{own}' in out and 'python -m' not in out
    assert f'\n  {script} --' in out
    assert '--logtostderr' not in out
  assert '\n  fedjax-mr-pretrain-zoo --workdir=runs/pool' in out  # stitch's
  full = helps('fedjax-mr-run', '--helpfull')
  assert full.startswith('Runs one federated training experiment.')
  assert '  --fedprox_mu:' in full and '  --[no]logtostderr:' in full


def _setup_install_options():
  """The options after `-e '.[test]'` of each of scripts/setup.sh's
  installs of the checkout (uv's, and pip's where uv fails)."""
  with open(os.path.join(ROOT, 'scripts', 'setup.sh')) as f:
    script = f.read().replace('\\\n', ' ')
  commands = [line for line in script.splitlines() if "-e '.[test]'" in line]
  assert len(commands) == 2, commands  # uv, then pip
  return [
    line.split("'.[test]'", 1)[1].split(';')[0].split() for line in commands
  ]


@pytest.mark.parametrize('strict', [True, False], ids=['setup', 'lenient'])
def test_a_script_beside_the_clone_imports_the_package(tmp_path, strict):
  # A clone in a folder named like the package, and a script in the
  # folder that holds it: its first sys.path entry holds the clone's
  # folder, `fedjax_mr/` without an `__init__.py`. Under the setup's
  # install (strict editable mode: a link tree on sys.path) the script
  # gets the package; under setuptools' default (lenient) mode it got
  # that folder as an empty namespace package, which this checks too.
  clone = tmp_path / 'fedjax_mr'
  clone.mkdir()
  for name in ['pyproject.toml', 'setup.cfg', 'README.md', 'LICENSE']:
    shutil.copy(os.path.join(ROOT, name), clone / name)
  for folder in ['fedjax_mr', 'experiments']:
    shutil.copytree(
      os.path.join(ROOT, folder),
      clone / folder,
      ignore=shutil.ignore_patterns('__pycache__'),
    )
  uv, pip = _setup_install_options()
  assert uv == pip == ['--config-settings', 'editable_mode=strict'], (uv, pip)
  options = pip
  prefix = tmp_path / 'prefix'
  subprocess.run(
    [sys.executable, '-m', 'pip', '--disable-pip-version-check', '-q']
    # --ignore-installed: this environment's own install of the package
    # stays (pip would otherwise uninstall it first).
    + ['install', '--no-deps', '--no-build-isolation', '--ignore-installed']
    + ['--prefix', prefix]
    + ['-e', str(clone)]
    + (options if strict else []),
    check=True,
    capture_output=True,
  )
  (site_dir,) = prefix.glob('lib/python*/site-packages')
  (tmp_path / 'script.py').write_text(
    'import site, sys\n'
    f'site.addsitedir({str(site_dir)!r})\n'
    'import fedjax_mr\n'
    "print(fedjax_mr.__file__, 'load_dataset' in fedjax_mr._EXPORTS)\n"
  )
  # -S: only the clone's install, not this environment's own.
  proc = subprocess.run(
    [sys.executable, '-S', 'script.py'],
    cwd=tmp_path,
    capture_output=True,
    text=True,
  )
  if strict:
    assert proc.returncode == 0, proc.stderr
    where, exported = proc.stdout.split()
    assert where.startswith(str(clone / 'build')), where
    assert exported == 'True'
  else:  # the namespace package: the error a user met
    assert proc.returncode == 1, proc.stdout
    assert "module 'fedjax_mr' has no attribute" in proc.stderr, proc.stderr


def test_a_program_or_a_node_loads_the_accountants_only_for_privacy():
  # dp-accounting and scipy (its optimizers, statistics, signals) were
  # 0.9 s of the 2.3 s of CPU a program took to start (AMD EPYC), paid by
  # every program and every warm SuperExec of a federation: imported when
  # an ε or a Skellam draw is first asked for.
  code = (
    'import sys, experiments.run, fedjax_mr.deploy.flower.warm; '
    "print(sorted(m for m in ('dp_accounting', 'scipy') if m in sys.modules))"
  )
  proc = subprocess.run(
    [sys.executable, '-c', code],
    cwd=ROOT,
    env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'},
    capture_output=True,
    text=True,
  )
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.split() == ['[]']
