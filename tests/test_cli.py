"""The programs' shared plumbing (experiments/cli.py): flagfiles, one-line
errors and the library's backticked names rendered as flags."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from absl import flags

from experiments import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_flagfile_is_replaced_by_its_lines_and_nests_beside_itself(
  tmp_path, monkeypatch
):
  (tmp_path / 'sub').mkdir()
  (tmp_path / 'sub' / 'inner.flags').write_text(
    '# a comment\n\n--rounds=3\n// another\n  --lr=0.5  \n'
  )
  (tmp_path / 'sub' / 'outer.flags').write_text(
    '--seed=1\n--flagfile=inner.flags\n--rounds=4\n'
  )
  monkeypatch.chdir(tmp_path)
  got = cli.expand_flagfiles(
    ['--a=1', '--flagfile=sub/outer.flags', '--flagfile', 'sub/inner.flags']
  )
  assert got == [
    '--a=1',
    '--seed=1',
    '--rounds=3',
    '--lr=0.5',
    '--rounds=4',
    '--rounds=3',
    '--lr=0.5',
  ]


def test_the_bundled_configs_are_found_by_name_from_anywhere(
  tmp_path, monkeypatch
):
  monkeypatch.chdir(tmp_path)
  default = cli.expand_flagfiles(['--flagfile=default.flags'])
  assert '--algorithm=fedavg' in default and '--alpha=0.1' in default
  assert cli.expand_flagfiles(['--flagfile=default']) == default
  assert (
    cli.expand_flagfiles(['--flagfile=experiments/configs/default.flags'])
    == default
  )
  # fmnist_table names experiments/configs/default.flags first.
  table = cli.expand_flagfiles(['--flagfile=fmnist_table'])
  assert table[: len(default)] == default and '--rounds=100' in table
  assert 'fmnist_table.flags' in cli.bundled_configs()


def test_a_path_of_the_users_own_is_never_swapped_for_a_bundled_one(
  tmp_path, monkeypatch, capsys
):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SystemExit) as e:
    cli.expand_flagfiles(['--flagfile=mine/default.flags'])
  assert e.value.code == cli.EXIT_USAGE
  err = capsys.readouterr().err
  assert err.count('\n') == 1
  assert err.startswith('error: --flagfile=mine/default.flags: no such file')
  assert 'fmnist_table' in err


def test_a_flagfile_that_includes_itself_is_one_line(tmp_path, capsys):
  loop = tmp_path / 'loop.flags'
  loop.write_text(f'--flagfile={os.path.basename(loop)}\n')
  with pytest.raises(SystemExit):
    cli.expand_flagfiles([f'--flagfile={loop}'])
  err = capsys.readouterr().err
  assert err.startswith('error: --flagfile=loop.flags: it includes itself')


def _fails(capsys, argv) -> str:
  """The one error line `expand_flagfiles(argv)` ends with."""
  with pytest.raises(SystemExit) as e:
    cli.expand_flagfiles(argv)
  assert e.value.code == cli.EXIT_USAGE
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and err.startswith('error: '), err
  return err[len('error: ') : -1]


def test_a_flagfile_that_is_not_a_regular_file_is_named_as_what_it_is(
  tmp_path, capsys
):
  assert _fails(capsys, [f'--flagfile={tmp_path}']) == (
    f'--flagfile={tmp_path}: is a folder'
  )
  assert _fails(capsys, ['--flagfile=/dev/null']) == (
    '--flagfile=/dev/null: is not a regular file (a character device)'
  )
  fifo = tmp_path / 'fifo'
  os.mkfifo(fifo)  # open() would wait for a writer
  assert _fails(capsys, [f'--flagfile={fifo}']) == (
    f'--flagfile={fifo}: is not a regular file (a FIFO)'
  )


def test_flagfiles_are_bounded_each_and_all_together(
  tmp_path, monkeypatch, capsys
):
  monkeypatch.setattr(cli, 'MAX_FLAGFILE_BYTES', 100)
  big = tmp_path / 'big.flags'
  big.write_text('--seed=1\n' * 12)  # 108 bytes: refused before reading
  assert _fails(capsys, [f'--flagfile={big}']) == (
    f'--flagfile={big}: holds 108 bytes, more than the 100 allowed (the '
    'flagfiles of a command hold 100 bytes at most, all together)'
  )
  half = tmp_path / 'half.flags'
  half.write_text('--seed=1\n' * 6)  # 54 bytes: once is fine, twice not
  assert cli.expand_flagfiles([f'--flagfile={half}']) == ['--seed=1'] * 6
  twice = tmp_path / 'twice.flags'
  twice.write_text('--flagfile=half.flags\n--flagfile=half.flags\n')  # 44
  assert _fails(capsys, [f'--flagfile={twice}']) == (
    '--flagfile=half.flags: holds 54 bytes, more than the 2 allowed (the '
    'flagfiles of a command hold 100 bytes at most, all together)'
  )


def test_flagfile_errors_quote_no_more_than_a_line(tmp_path, capsys):
  garbage = tmp_path / 'garbage.flags'
  garbage.write_bytes(b'--seed=\xff\n')
  assert _fails(capsys, [f'--flagfile={garbage}']) == (
    f'--flagfile={garbage}: not UTF-8 text (byte 0xff at offset 7)'
  )
  name = 'x' * 5000 + '\x1b[31m'
  err = _fails(capsys, [f'--flagfile={name}'])
  assert err.startswith(f'--flagfile={"x" * 200}…: no such file')
  assert 'x' * 201 not in err and '\x1b' not in err


def test_fail_clips_each_word_and_escapes_control_characters(capsys):
  with pytest.raises(SystemExit):
    cli.fail(f'bad value {"v" * 10_000} and\x1b[2J then\r\nmore')
  assert capsys.readouterr().err == (
    f'error: bad value {"v" * 300}… and\\x1b[2J then more\n'
  )
  with pytest.raises(SystemExit):
    cli.fail('w ' * 10_000)
  err = capsys.readouterr().err
  assert len(err) == len('error: ') + cli.MAX_ERROR_CHARS + len('…\n')


def test_positional_garbage_is_quoted_clipped(capsys):
  with pytest.raises(SystemExit):
    cli.no_arguments(['prog', *(['junk'] * 10_000)])
  err = capsys.readouterr().err
  assert err.startswith('error: unexpected arguments: junk junk')
  assert len(err) < 300 and '…' in err


def test_parse_flags_skips_absls_quadratic_flagfile_pass(monkeypatch):
  # absl's read_flags_from_files copies the rest of the arguments for each
  # one (70,000 flags: 12 s); expand_flagfiles has done its work already.
  def quadratic(self, argv, force_gnu=True):
    raise AssertionError('absl re-read the flagfiles')

  monkeypatch.setattr(flags.FlagValues, 'read_flags_from_files', quadratic)
  flags.DEFINE_integer('linear_test_only_flag', 1, '')
  try:
    assert cli.parse_flags(['prog', '--linear_test_only_flag=3']) == ['prog']
    assert flags.FLAGS.linear_test_only_flag == 3
  finally:
    flags.FLAGS.unparse_flags()
  assert 'read_flags_from_files' not in flags.FLAGS.__dict__


def test_render_turns_the_librarys_backticked_names_into_flags():
  fv = flags.FlagValues()
  flags.DEFINE_integer('rounds', 1, '', flag_values=fv)
  flags.DEFINE_string('partition', 'iid', '', flag_values=fv)
  flags.DEFINE_bool('resume', True, '', flag_values=fv)
  flags.DEFINE_bool('nothing', False, '', flag_values=fv)
  render = lambda text: cli.render(text, flag_values=fv)  # noqa: E731
  assert (
    render('`rounds` must be >= 1, got 0') == '--rounds must be >= 1, got 0'
  )
  assert render('`partition=natural`: no natural split') == (
    '--partition=natural: no natural split'
  )
  assert render('pass `rounds=5` or `noresume`') == (
    'pass --rounds=5 or --noresume'
  )
  # A flag whose own name starts with "no" is that flag.
  assert render('`nothing`') == '--nothing'
  # Not a flag of this program (a file, another program's word, "no" before
  # a flag that is not boolean): left as written.
  assert render('`config.json` and `alpha` and `norounds`') == (
    '`config.json` and `alpha` and `norounds`'
  )
  assert render('no backticks at all --x') == 'no backticks at all --x'


def test_fail_and_log_speak_in_flags(capsys):
  flags.DEFINE_integer('render_test_only_flag', 1, '')
  cli.log('`render_test_only_flag=3` and `unknown_name`')
  assert capsys.readouterr().out == (
    '--render_test_only_flag=3 and `unknown_name`\n'
  )
  with pytest.raises(SystemExit) as e:
    cli.fail('`render_test_only_flag` must be ≥ 1,\n got 0')
  assert e.value.code == cli.EXIT_USAGE
  assert capsys.readouterr().err == (
    'error: --render_test_only_flag must be ≥ 1, got 0\n'
  )


@pytest.mark.parametrize('made', [False, True])
def test_ctrl_c_before_the_workdir_exists_says_nothing_was_written(
  tmp_path, capsys, made
):
  workdir = tmp_path / 'run'
  with pytest.raises(SystemExit) as e:
    with cli.training_errors('re-run to resume', workdir=str(workdir)):
      if made:
        workdir.mkdir()
      raise KeyboardInterrupt
  assert e.value.code == 130
  said = capsys.readouterr().err
  assert said == (
    'interrupted; re-run to resume\n'
    if made
    else 'interrupted during start-up; nothing written\n'
  )


def _default_sigint(argv):
  """`argv` started with SIGINT at its default action.

  A child inherits an ignored SIGINT (a suite started in the background
  of a non-interactive shell, as CI may start it), and Python then keeps
  ignoring it: Ctrl-C is what these tests send, so restore it. A small
  Python restores it and then becomes `argv` (exec keeps the default
  action and the process id), rather than a `preexec_fn`, which would run
  Python in a child forked from this multithreaded process (JAX warns of
  deadlocks)."""
  restore = (
    'import os, signal, sys\n'
    'signal.signal(signal.SIGINT, signal.SIG_DFL)\n'
    'os.execv(sys.argv[1], sys.argv[1:])\n'
  )
  return [sys.executable, '-c', restore, *argv]


def _assert_interrupted_starting(code):
  """Python running `code` ends as Ctrl-C during start-up does."""
  proc = subprocess.run(
    _default_sigint([sys.executable, '-c', code]),
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert (proc.returncode, proc.stderr) == (
    130,
    'interrupted during start-up; nothing written\n',
  )


@pytest.mark.parametrize('name', ['SIGINT', 'SIGTERM'])
def test_ctrl_c_or_sigterm_while_a_program_imports_is_one_line(name):
  # Uncaught at the top, as during `python -m experiments.run`'s imports
  # (a SIGTERM there was a silent -15).
  code = (
    'import os, signal, time; from experiments import cli; '
    f'os.kill(os.getpid(), signal.{name}); time.sleep(30)'
  )
  _assert_interrupted_starting(code)


def test_sigterm_gets_its_default_back_once_the_flags_are_parsed():
  code = (
    'import signal, sys; from experiments import cli\n'
    'cli.run(lambda argv: print(signal.getsignal(signal.SIGTERM)'
    ' is signal.SIG_DFL))\n'
  )
  proc = subprocess.run(
    [sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True
  )
  assert (proc.returncode, proc.stdout) == (0, 'True\n'), proc.stderr


def test_ctrl_c_inside_a_collector_callback_is_not_lost():
  # Python runs the SIGINT handler at the next bytecode, which may be in a
  # gc callback (jax has one) or a __del__: the KeyboardInterrupt is then
  # "ignored" and the program ran on (CI: a run went on to round 5). Here
  # a __del__ raises it, as the handler would there.
  code = (
    'import threading\n'
    'from experiments import cli\n'
    'class Finalized:\n'
    '  def __del__(self):\n'
    '    raise KeyboardInterrupt\n'
    'Finalized()\n'
    'threading.Event().wait(30)  # blocked, as on the devices\n'
  )
  _assert_interrupted_starting(code)


def test_ctrl_c_while_another_unraisable_is_reported_is_not_lost():
  # The SIGINT arrives while the hook passes another error on (to the
  # hook before it): cli's handler marks it lost there instead of raising
  # it inside the hook, and the watcher sends it again afterwards.
  code = (
    'import os, signal, threading, time\n'
    'from experiments import cli\n'
    'def ctrl_c_meanwhile(unraisable):\n'
    '  os.kill(os.getpid(), signal.SIGINT)\n'
    '  time.sleep(0.1)\n'
    'cli._lost_interrupts.previous = ctrl_c_meanwhile\n'
    'class Finalized:\n'
    '  def __del__(self):\n'
    '    raise ValueError\n'
    'Finalized()\n'
    'threading.Event().wait(30)\n'
  )
  _assert_interrupted_starting(code)


def test_ctrl_c_early_in_a_run_is_one_line_and_writes_nothing(tmp_path):
  workdir = tmp_path / 'run'
  proc = subprocess.Popen(
    _default_sigint(
      [sys.executable, '-m', 'experiments.run', f'--workdir={workdir}']
    ),
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  time.sleep(1)  # importing, or loading: the workdir comes seconds later
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 130, err
  assert err == 'interrupted during start-up; nothing written\n'
  assert not workdir.exists()


def test_an_import_that_ctrl_c_broke_is_an_interrupt():
  # SIGINT inside tensorstore's module initialization (orbax imports it)
  # came out as `ImportError: initialization failed`, the interrupt its
  # cause: a traceback and exit 1 where Ctrl-C says one line (seen once
  # in test_ctrl_c_early_in_a_run_is_one_line_and_writes_nothing).
  def broken_import():
    try:
      raise KeyboardInterrupt
    except KeyboardInterrupt as e:
      raise ImportError('initialization failed') from e

  try:
    broken_import()
  except ImportError as e:
    assert cli.caused_by_interrupt(e)
  try:
    try:
      raise KeyboardInterrupt
    except KeyboardInterrupt:
      raise ValueError('while handling it')  # noqa: B904 - the context
  except ValueError as e:
    assert cli.caused_by_interrupt(e)
  assert not cli.caused_by_interrupt(ImportError('no module named x'))
  assert not cli.caused_by_interrupt(None)
  loop = ValueError('a')
  loop.__context__ = ValueError('b')
  loop.__context__.__context__ = loop
  assert not cli.caused_by_interrupt(loop)


def test_out_of_memory_in_a_run_is_one_line(tmp_path):
  # XLA's RESOURCE_EXHAUSTED (FedMR at K = 60,000 asked for 31.7 GB) as
  # the run raises it; the program names --clients_per_round.
  code = (
    'import sys, jax\n'
    'from experiments import run\n'
    'from fedjax_mr.pipeline import experiment\n'
    'def oom(config, log):\n'
    '  raise jax.errors.JaxRuntimeError(\n'
    "    'RESOURCE_EXHAUSTED: Out of memory allocating 31700000000 bytes.\\n'\n"
    "    'more XLA lines')\n"
    'experiment.train_and_evaluate = oom\n'
    f"sys.argv = ['run', '--workdir={tmp_path}/w', '--clients_per_round=7']\n"
    'run.entry()\n'
  )
  proc = subprocess.run(
    [sys.executable, '-c', code],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 2
  assert re.fullmatch(
    r'error: out of memory \(RESOURCE_EXHAUSTED: Out of memory allocating '
    r'31700000000 bytes\.; this machine has [\d.]+ GiB\): a round of '
    r'--clients_per_round=7 does not fit; lower it, or --client_chunk '
    r'\(clients trained at once on a device\)\n',
    proc.stderr,
  ), proc.stderr


def test_every_program_imports_cli_first():
  # cli's import hook turns Ctrl-C during the program's own (slow) imports
  # into its one line, so it must come before them.
  import ast
  import pathlib

  for path in sorted((pathlib.Path(REPO) / 'experiments').glob('*.py')):
    source = path.read_text()
    if 'cli.run(' not in source:
      continue
    imports = [
      node
      for node in ast.parse(source).body
      if isinstance(node, (ast.Import, ast.ImportFrom))
      and not (isinstance(node, ast.ImportFrom) and node.module == '__future__')
    ]
    first = next(
      i
      for i in imports
      if not (isinstance(i, ast.Import) and i.names[0].name == 'os')
    )
    assert isinstance(first, ast.ImportFrom) and first.level == 1, path.name
    assert [a.name for a in first.names] == ['cli'], path.name


def test_render_keeps_a_line_one_line_when_a_flag_value_holds_a_newline():
  # A workdir named 'a\nb' split the run's last output line in two.
  fv = flags.FlagValues()
  flags.DEFINE_string('workdir', '', '', flag_values=fv)
  fv(['prog', '--workdir=/tmp/a\nb'])
  line = cli.render('workdir /tmp/a\nb: metrics.jsonl', flag_values=fv)
  assert line == 'workdir /tmp/a\\nb: metrics.jsonl'
  assert cli.render('`workdir=/tmp/a\nb`: in use', flag_values=fv) == (
    '--workdir=/tmp/a\\nb: in use'
  )


def test_installed_each_program_is_named_by_its_console_script():
  assert cli.installed_names(
    '  python -m experiments.pretrain_zoo --workdir=runs/pool\n'
    '  sudo .venv/bin/python -m experiments.profile_device --dry_run\n'
    'as `experiments.stitch` writes it'
  ) == (
    '  fedjax-mr-pretrain-zoo --workdir=runs/pool\n'
    '  sudo fedjax-mr-profile-device --dry_run\n'
    'as `experiments.stitch` writes it'
  )


def test_the_help_names_the_other_programs_as_they_are_run_here(tmp_path):
  # fedjax-mr-stitch --help said `python -m experiments.pretrain_zoo`,
  # which works only in a checkout. A console script is a wrapper whose
  # __main__ is not the program, as this one.
  script = tmp_path / 'fedjax-mr-stitch'
  script.write_text('from experiments.stitch import entry\nentry()\n')
  env = {**os.environ, 'PYTHONPATH': REPO, 'TF_CPP_MIN_LOG_LEVEL': '2'}
  helps = [
    subprocess.run(
      [sys.executable, *argv, '--help'],
      cwd=tmp_path,
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
    )
    for argv in ([str(script)], ['-m', 'experiments.stitch'])
  ]
  installed, checkout = (proc.stdout for proc in helps)
  assert '\n  fedjax-mr-pretrain-zoo --workdir=runs/pool\n' in installed
  assert '\n  fedjax-mr-stitch --pool=runs/pool' in installed
  assert 'python -m' not in installed
  assert '\n  python -m experiments.pretrain_zoo --workdir' in checkout
