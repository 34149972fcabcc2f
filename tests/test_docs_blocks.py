"""The code blocks of the quickstart, the how-tos and the results pages,
as they print them.

Every block says what it is (```python, ```sh, ```text). A Python block
runs, in a folder of its own, and must exit cleanly; the README's library
example (run by tests/test_readme.py) and the add-an-algorithm module (run
by tests/test_docs_add_algorithm.py) are the same text as there. A shell
block may need hardware or hours this machine lacks (a GPU, several
hosts, a Jetson, the main job), so each of its commands is checked as far
as it can be here: it parses, each `python -m experiments.<program>` (or
its console script) knows every flag it is given, each extra that
`pip install` names exists, and each script or path it runs is there.
"""

import functools
import importlib.metadata
import os
import re
import shlex

import pytest
import tomllib

from tests import docs_text
from tests import fork_server

REPO = docs_text.REPO
PAGES = ['docs/quickstart.md'] + sorted(
  os.path.join('docs', folder, name)
  for folder in ('howto', 'results')
  for name in os.listdir(os.path.join(REPO, 'docs', folder))
  if name.endswith('.md')
)
LANGUAGES = {'python', 'sh', 'text'}
# Commands a shell block may use besides the programs, pip and pytest.
PLAIN_COMMANDS = {'sudo', 'cd', 'mkdir', 'cp', 'ls', 'cat', 'source', 'flwr'}


def blocks(name):
  """(language, code, line) of each fenced block of page `name`."""
  found, lines = [], docs_text.read(name).splitlines()
  start = None
  for i, line in enumerate(lines):
    if line.startswith('```') and start is None:
      start, language = i, line[3:].strip()
    elif line.startswith('```'):
      found.append((language, '\n'.join(lines[start + 1 : i]) + '\n', start))
      start = None
  assert start is None, f'{name}: a block is not closed'
  return found


def _readme_example():
  text = docs_text.read('README.md')
  return re.search(r'<!-- readme-example -->\n```python\n(.*?)```', text, re.S)[
    1
  ]


CASES = [
  (name, language, code, line)
  for name in PAGES
  for language, code, line in blocks(name)
]
PYTHON = [c for c in CASES if c[1] == 'python']
SHELL = [c for c in CASES if c[1] == 'sh']


def _id(case):
  return f'{case[0]}:{case[3] + 1}'


def test_no_command_writes_into_the_records():
  # A program's output folder is never a tracked record folder: the
  # figure commands draw from a copy under runs/ (git ignores it).
  for case in SHELL:
    for command in commands(case[2]):
      for arg in command:
        flag, _, value = arg.partition('=')
        if flag in ('--workdir', '--output', '--out'):
          assert not value.startswith('docs/'), (_id(case), arg)


def test_every_block_says_what_it_is():
  assert {language for _, language, _, _ in CASES} <= LANGUAGES, [
    _id(c) for c in CASES if c[1] not in LANGUAGES
  ]
  assert PYTHON and SHELL


@pytest.mark.parametrize('case', PYTHON, ids=[_id(c) for c in PYTHON])
def test_python_block_runs(case, tmp_path):
  name, _, code, _ = case
  if code == _readme_example():
    return  # tests/test_readme.py runs it
  if name.endswith('add-algorithm.md'):
    return  # tests/test_docs_add_algorithm.py imports and runs both blocks
  # `python -c`, in a process forked from one that imported the libraries
  # (tests/fork_server.py).
  proc = fork_server.run_module('-c', code, cwd=tmp_path, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  expected = re.search(r'this prints\s+`([^`]+)`', docs_text.read(name))
  if expected and expected[1].split()[0] in code:
    assert proc.stdout.strip() == expected[1], proc.stdout


def test_the_quickstarts_example_is_the_readmes():
  (code,) = [c[2] for c in PYTHON if c[0] == 'docs/quickstart.md']
  assert code == _readme_example()


def commands(code):
  """The commands of a shell block: continuations joined, comments
  dropped, split at `&&`, `;` and lines; VAR=value words expanded."""
  code = code.replace('\\\n', ' ')
  out, variables = [], {}
  for line in code.splitlines():
    words = shlex.split(line, comments=True)
    command = []
    for word in words + [';']:
      if word in ('&&', ';', '||', '&'):
        if command:
          out.append(command)
        command = []
        continue
      if not command and re.fullmatch(r'[A-Z_]+=.*', word):
        key, value = word.split('=', 1)
        for k, v in variables.items():
          value = value.replace(f'${k}', v)
        variables[key] = value
        continue
      if word[1:] in variables and word.startswith('$'):
        command += shlex.split(variables[word[1:]])  # S="python -m ..."
        continue
      for key, value in variables.items():
        word = word.replace(f'${key}', value)
      command.append(word)
  return out


@functools.cache
def program_flags(program):
  """The flags `python -m experiments.<program>` knows (its --helpfull)."""
  # Its own process, forked from one that imported the libraries the
  # programs share (tests/fork_server.py).
  proc = fork_server.run_module(
    f'experiments.{program}', '--helpfull', cwd=REPO, timeout=300
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  flags = set()
  for match in re.finditer(r'^\s+--(\[no\])?(\w+):', proc.stdout, re.M):
    flags.add(match[2])
    if match[1]:
      flags.add('no' + match[2])
  return flags


def _program(command):
  """(program, arguments) of a command that runs one, else None."""
  words = command[1:] if command[0] == 'sudo' else command
  if (
    re.fullmatch(r'(\.venv/bin/)?python3?', words[0])
    and words[1:3]
    and (words[1] == '-m' and words[2].startswith('experiments.'))
  ):
    return words[2].split('.', 1)[1], words[3:]
  if words[0].startswith('fedjax-mr-'):
    return words[0][len('fedjax-mr-') :].replace('-', '_'), words[1:]
  return None


def _pyproject():
  with open(os.path.join(REPO, 'pyproject.toml'), 'rb') as f:
    return tomllib.load(f)


def check_command(command):
  """Checks one command as far as this machine allows (see above)."""
  if program := _program(command):
    name, args = program
    assert os.path.exists(os.path.join(REPO, 'experiments', name + '.py')), name
    known = program_flags(name)
    for arg in args:
      if arg.startswith('--'):
        flag = arg[2:].split('=', 1)[0]
        assert flag in known, f'experiments.{name} has no --{flag}'
    return
  words = command[1:] if command[0] == 'sudo' else command
  tool = os.path.basename(words[0])
  if tool == 'pip' or words[1:3] == ['-m', 'pip']:
    wanted = [w for w in words if '[' in w]
    assert wanted, command
    for requirement in wanted:
      project, extra = re.match(r'([\w.-]+)\[([\w,-]+)\]', requirement).groups()
      if project == '.':
        extras = _pyproject()['project']['optional-dependencies']
        assert extra in extras, extra
      else:  # a dependency's extra, at the versions pyproject.toml allows
        meta = importlib.metadata.metadata(project)
        assert extra in meta.get_all('Provides-Extra'), (project, extra)
        pinned = [
          d.replace(' ', '')[len(project) :]
          for d in _pyproject()['project']['dependencies']
          if re.match(rf'{project}\W', d)
        ]
        asked = requirement.split(']', 1)[1]
        assert asked in pinned, (requirement, pinned)
  elif tool == 'bash':
    assert os.path.isfile(os.path.join(REPO, words[1])), words[1]
  elif re.fullmatch(r'python3?', tool) and words[1:3] == ['-m', 'pytest']:
    paths = [w for w in words[3:] if not w.startswith('-') and '/' in w]
    assert all(os.path.exists(os.path.join(REPO, p)) for p in paths), paths
  elif re.fullmatch(r'python3?', tool) and words[1] == '-c':
    compile(words[2], '<-c>', 'exec')
  elif re.fullmatch(r'python3?', tool) and words[1] == '-m':
    # A module of the package run as a program (Flower's, wrapped).
    assert words[2].startswith('fedjax_mr.'), words[2]
    module = os.path.join(REPO, *words[2].split('.')) + '.py'
    assert os.path.isfile(module), words[2]
  else:
    assert tool in PLAIN_COMMANDS, f'a command this test does not know: {tool}'


@pytest.mark.parametrize('case', SHELL, ids=[_id(c) for c in SHELL])
def test_shell_block_commands_and_flags_exist(case):
  found = commands(case[2])
  assert found, 'an empty block'
  for command in found:
    check_command(command)


@pytest.mark.parametrize(
  'command, says',
  [
    ('python -m experiments.run --roundz=3', 'has no --roundz'),
    ('python -m experiments.nope --rounds=3', 'nope'),
    (".venv/bin/pip install -e '.[nope]'", 'nope'),
    ('.venv/bin/pip install -U "jax[cuda12]>=0.9,<0.10"', 'jax'),
    ('bash scripts/nope.sh', 'nope.sh'),
    ('python -m fedjax_mr.deploy.nope --x', 'fedjax_mr.deploy.nope'),
    ('python -m http.server', 'http.server'),
    ('rm -rf runs', 'does not know: rm'),
  ],
)
def test_a_wrong_command_fails_its_check(command, says):
  check_command(['python', '-m', 'experiments.run', '--rounds=3'])
  with pytest.raises(AssertionError, match=re.escape(says)):
    for c in commands(command):
      check_command(c)
