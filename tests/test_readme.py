"""The README's library example runs as written, its commands exist, and
it stays a landing page."""

import os
import re

from tests import docs_text
from tests import fork_server

REPO = os.path.dirname(os.path.dirname(__file__))


def _readme():
  with open(os.path.join(REPO, 'README.md')) as f:
    return f.read()


def test_library_example_runs_and_learns():
  text = _readme()
  code = re.search(r'<!-- readme-example -->\n```python\n(.*?)```', text, re.S)
  assert code, 'README example block not found'
  lines = code.group(1).strip().splitlines()
  assert len(lines) <= 25
  # `python -c`, in a process forked from one that imported the libraries
  # (tests/fork_server.py); this process's environment.
  proc = fork_server.run_module(
    '-c', code.group(1), cwd=REPO, env=dict(os.environ), timeout=600
  )
  assert proc.returncode == 0, proc.stderr
  rows = [line.split() for line in proc.stdout.strip().splitlines()]
  assert [int(r[0]) for r in rows] == [1, 2, 3]
  assert float(rows[-1][1]) > 0.4  # learning (chance is 0.1)


def test_ci_runs_the_readme_test_command():
  text = _readme()
  commands = re.findall(r'```\n(bash scripts/setup.sh && .*?)\n```', text)
  assert len(commands) == 2
  with open(os.path.join(REPO, '.ci', 'run')) as f:
    ci = f.read()
  assert commands[1] in ci.splitlines()
  assert 'experiments.compare' in commands[0]


def test_the_readme_is_a_landing_page():
  text = _readme()
  assert len(text.splitlines()) <= 200
  # No suite timings, test counts or machine names: those are records'.
  assert not re.search(r'\b[\d,]+ tests\b', text)
  assert not re.search(r'\d+(\.\d+)? (minutes|min|s) (on|from)\b', text)
  assert not re.search(r'Intel|AMD|EPYC|Sapphire|H100|H200', text)
  for heading in ('## Set up and run', '## As a library', '## How to cite'):
    assert heading in text, heading


def test_the_docs_say_how_to_install_tensorboard():
  import tomllib

  text = ' '.join(docs_text.all_text().split())
  extra = re.search(
    r"`\.venv/bin/pip install -e '\.\[(\w+)\]' "
    r'--config-settings editable_mode=strict`, then '
    r'`\.venv/bin/tensorboard --logdir runs/default`',
    text,
  )
  assert extra, 'no TensorBoard instruction'
  with open(os.path.join(REPO, 'pyproject.toml'), 'rb') as f:
    extras = tomllib.load(f)['project']['optional-dependencies']
  assert any(r.startswith('tensorboard>') for r in extras[extra.group(1)]), (
    extras
  )


def test_the_docs_name_every_console_script():
  import tomllib

  with open(os.path.join(REPO, 'pyproject.toml'), 'rb') as f:
    scripts = set(tomllib.load(f)['project']['scripts'])
  named = set(re.findall(r'`(fedjax-mr-[a-z-]+)`', docs_text.all_text()))
  assert named == scripts, (scripts - named, named - scripts)


def test_the_readmes_links_lead_somewhere():
  # Relative links name files or folders of the checkout; the documentation
  # pages' own links are checked by the strict site build.
  links = re.findall(r'\]\(([^)\s]+)\)', _readme())
  local = [link.split('#')[0] for link in links if '://' not in link]
  assert local
  missing = [
    link for link in local if not os.path.exists(os.path.join(REPO, link))
  ]
  assert not missing, missing
