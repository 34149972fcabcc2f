"""What every program of `experiments/` shares: flags and one-line errors.

`run(main)` replaces `absl.app.run(main)`: a flag that does not parse (an
unknown flag, `--rounds=abc`, a missing flagfile) and `fail(...)` both print
`error: <message>` on stderr as a single line and exit with code 2 — no
usage text, no traceback. `--flagfile` also finds the bundled configs by
name (`--flagfile=fmnist_table`), from any folder and from an installed
package, where the programs are `fedjax_mr.experiments.<name>` and the
console scripts `fedjax-mr-<name>`.

The library names what it was given in backticks (`rounds`,
`partition=iid`: an argument or a config field); a program speaks in
flags, so `render` turns each backticked name that is one of the
program's flags into the flag (`--rounds`, `--partition=iid`), in error
lines (`fail`), progress lines (`log`) and warnings alike. This is the one
place where an argument becomes a flag.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import sys
import textwrap
import threading
import time
import warnings
from typing import Any
from typing import Callable
from typing import NoReturn
from typing import Sequence

from absl import app
from absl import flags

from fedjax_mr.core import errors
from fedjax_mr.core import jsonfile

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for Ctrl-C
NOTHING_WRITTEN = 'interrupted during start-up; nothing written'


def caused_by_interrupt(error: BaseException | None) -> bool:
  """Whether `error` is a KeyboardInterrupt or was raised while handling
  one: Ctrl-C inside a C extension's module initialization comes out as
  `ImportError: initialization failed`, the interrupt its cause."""
  seen = set()
  while error is not None and id(error) not in seen:
    if isinstance(error, KeyboardInterrupt):
      return True
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  return False


def _interrupted_starting(kind, value, traceback) -> None:
  """`sys.excepthook` while a program imports its modules: Ctrl-C there
  (seconds: jax, flax, orbax) is one line and exit code 130."""
  if issubclass(kind, KeyboardInterrupt) or caused_by_interrupt(value):
    sys.stdout.flush()
    print(NOTHING_WRITTEN, file=sys.stderr, flush=True)
    os._exit(EXIT_INTERRUPTED)  # an excepthook cannot raise SystemExit
  _python_excepthook(kind, value, traceback)


# The programs import this module before any other of theirs (`isort:
# split`); `run` puts Python's hook back once the flags are parsed, and
# `training_errors` speaks for Ctrl-C from there on.
_python_excepthook = sys.excepthook
sys.excepthook = _interrupted_starting


class _LostInterrupts:
  """Does not let Ctrl-C be lost. Python runs its SIGINT handler at the
  next bytecode, which may be inside a garbage-collector callback (jax
  registers one), a `__del__` or a weakref callback; the
  KeyboardInterrupt raised there cannot propagate, Python passes it to
  `sys.unraisablehook` ("Exception ignored") and the program runs on.

  `hook`, the process's `sys.unraisablehook`, prints nothing for such a
  KeyboardInterrupt and marks it lost; a watcher thread (started then)
  sends the signal again to the main thread once the hook has returned,
  every 50 ms while one is lost, so that it lands outside the callback
  and a blocking call there (a sleep, a wait on the devices) returns.
  `on_sigint`, the SIGINT handler, raises KeyboardInterrupt as Python's
  does, but not inside `hook`, where it would be lost again: there it
  marks the interrupt lost. SIGTERM, which the training loops turn into
  KeyboardInterrupt, is sent as itself where SIGINT is ignored. Anything
  else goes to `previous`."""

  POLL_S = 0.05

  def __init__(self, previous):
    self.previous = previous
    self.lost = False  # plain flags: the handler may run inside `hook`
    self.in_hook = False
    self.watcher = None

  def on_sigint(self, signum, frame) -> None:
    if self.in_hook:
      self.lost = True
      return
    raise KeyboardInterrupt

  def hook(self, unraisable) -> None:
    self.in_hook = True
    try:
      if isinstance(unraisable.exc_value, KeyboardInterrupt):
        self.lost = True
      else:
        self.previous(unraisable)  # Ctrl-C here is marked lost too
      if self.lost and self.watcher is None:
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()
    finally:
      self.in_hook = False

  def _watch(self) -> None:
    main = threading.main_thread().ident
    while True:
      time.sleep(self.POLL_S)
      if not self.lost or self.in_hook:
        continue
      self.lost = False
      for signum in (signal.SIGINT, signal.SIGTERM):
        if callable(signal.getsignal(signum)):
          signal.pthread_kill(main, signum)
          break


_lost_interrupts = _LostInterrupts(sys.unraisablehook)
sys.unraisablehook = _lost_interrupts.hook
_MAIN_THREAD = threading.current_thread() is threading.main_thread()
if (
  _MAIN_THREAD and signal.getsignal(signal.SIGINT) is signal.default_int_handler
):  # not where SIGINT is ignored (a background job) or already handled
  signal.signal(signal.SIGINT, _lost_interrupts.on_sigint)
# While the program imports, SIGTERM is Ctrl-C too (one line, 130, not a
# silent -15); `run` gives it back its default once the flags are parsed,
# and the training loops turn it into KeyboardInterrupt themselves.
_TERM_AT_START = _MAIN_THREAD and signal.getsignal(signal.SIGTERM) in (
  signal.SIG_DFL,
  None,
)
if _TERM_AT_START:
  signal.signal(signal.SIGTERM, _lost_interrupts.on_sigint)


# `name`, `noname` or `name=value` in backticks.
_NAMED = re.compile(r'`(no)?([a-z][a-z0-9_]*)((?:=[^`]*)?)`')


def render(text: str, flag_values: flags.FlagValues = flags.FLAGS) -> str:
  """`text` in the program's words: each backticked name (with or without
  a value) that is one of its flags (`flag_values`) becomes the flag
  (`rounds=5` -> --rounds=5, `noresume` -> --noresume of a boolean flag);
  other backticked words stay as they are. A flag's text value that holds
  a control character (a newline in a folder's name) is shown with
  escapes wherever it appears, so that a line stays one line."""

  def flag(match: re.Match) -> str:
    no, name, value = match.groups()
    if no and no + name in flag_values:
      name, no = no + name, None
    if name not in flag_values:
      return match.group(0)
    if no and not isinstance(flag_values[name].default, bool):
      return match.group(0)
    return f'--{no or ""}{name}{value}'

  text = _NAMED.sub(flag, str(text))
  for name in flag_values:
    value = flag_values[name].value
    if isinstance(value, str) and value and not value.isprintable():
      text = text.replace(value, errors.escape(value))
  return text


def log(line: str) -> None:
  """A progress line of the library, in the program's words (`render`)."""
  print(render(line), flush=True)


# The longest error line `fail` prints, and the longest word in it: a
# line, not a file's worth of what the user gave. A word may hold a flag's
# name and a value already clipped to `errors.CLIP_CHARS`.
MAX_ERROR_CHARS = 2000
MAX_WORD_CHARS = errors.CLIP_CHARS + 100


def fail(message: str) -> NoReturn:
  """Prints `error: message` (one line, in the program's words: `render`)
  on stderr and exits with code 2. Whatever the message holds, the line
  is one: whitespace runs become one space, control characters escapes,
  and a word longer than `MAX_WORD_CHARS` (a pasted file, a huge value)
  and the line past `MAX_ERROR_CHARS` are cut with an ellipsis."""
  words = render(message).split()
  line = ' '.join(errors.clip(w, MAX_WORD_CHARS) for w in words)
  line = errors.clip(line, MAX_ERROR_CHARS)
  print(f'error: {line}', file=sys.stderr)
  sys.exit(EXIT_USAGE)


@contextlib.contextmanager
def training_errors(resume_hint: str, workdir: str | None = None):
  """What a training program can meet, as one line and an exit code: bad
  input (2, `fail`), a non-finite loss (3) and Ctrl-C or SIGTERM (130,
  then `resume_hint`: how to resume; or, where the run's output folder
  `workdir` did not exist before and still does not, that nothing was
  written)."""
  fresh = workdir is not None and not os.path.exists(workdir)
  try:
    yield
  except errors.UserError as e:
    fail(str(e))
  except errors.NonFiniteError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(3)
  except (KeyboardInterrupt, ImportError) as e:
    if not caused_by_interrupt(e):  # an ImportError of its own
      raise
    if fresh and not os.path.exists(workdir):
      print(NOTHING_WRITTEN, file=sys.stderr)
    else:
      print(f'interrupted; {resume_hint}', file=sys.stderr)
    sys.exit(EXIT_INTERRUPTED)


# The flagfiles that come with the package (the papers' settings).
CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs')


def bundled_configs() -> list[str]:
  """The names of the flagfiles in `CONFIGS`."""
  return sorted(n for n in os.listdir(CONFIGS) if n.endswith('.flags'))


# What the flagfiles of one command may hold, each and all together once
# expanded (a flagfile that includes another many times): the largest
# bundled config is 2 KB, 40 flags; 1 MiB is 500 of it, and even as
# 131,000 one-word flags parses in under 0.6 s (`parse_flags`).
MAX_FLAGFILE_BYTES = 1 << 20


def _flagfile_path(name: str, including: str | None) -> str:
  """Where `--flagfile=name` is: the path as given (from the working
  folder), else beside the flagfile that names it, else a bundled config
  (`name`, with or without `.flags`, or `experiments/configs/<name>`).
  A path that is there but is no regular file (a folder, a device) is
  refused as what it is."""
  name = os.path.expanduser(name)
  candidates = [name]
  if including is not None and not os.path.isabs(name):
    candidates.append(os.path.join(os.path.dirname(including), name))
  folder, base = os.path.split(name)
  if folder in ('', os.path.join('experiments', 'configs')):
    candidates += [
      os.path.join(CONFIGS, base),
      os.path.join(CONFIGS, base + '.flags'),
    ]
  where = f' (named in {errors.clip(including)})' if including else ''
  found = [p for p in candidates if os.path.exists(p)]
  for path in found:
    if os.path.isfile(path):
      return path
  if found:
    why = jsonfile.not_regular(os.stat(found[0]).st_mode)
    fail(f'--flagfile={errors.clip(name)}{where}: {why}')
  fail(
    f'--flagfile={errors.clip(name)}{where}: no such file; the bundled '
    f'configs are {", ".join(n[: -len(".flags")] for n in bundled_configs())}'
  )


def _read_flagfile(name: str, path: str, budget: list[int]) -> list[str]:
  """The flag lines of the flagfile `path` (`--flagfile=name`), whose
  bytes count against `budget` ([bytes left for this command])."""
  where = f'--flagfile={errors.clip(name)}'
  try:
    data = jsonfile.read_bytes(path, budget[0])
  except jsonfile.JsonFileError as e:
    too_large = e.reason.startswith('holds ')
    fail(
      f'{where}: {e.reason}'
      + (
        f' (the flagfiles of a command hold {MAX_FLAGFILE_BYTES:,} bytes '
        'at most, all together)'
        if too_large
        else ''
      )
    )
  budget[0] -= len(data)
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as e:
    fail(
      f'{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset '
      f'{e.start})'
    )
  lines = (line.strip() for line in text.splitlines())
  return [line for line in lines if line and not line.startswith(('#', '//'))]


def expand_flagfiles(argv: list[str]) -> list[str]:
  """`argv` with every `--flagfile=F` replaced by F's lines (recursively).

  A flagfile holds one flag per line; blank lines and lines starting with
  `#` or `//` are skipped. F is found by `_flagfile_path`, so the bundled
  configs work from any folder and from an installed package, and a
  flagfile names another by its path relative to itself. The flagfiles
  read hold at most `MAX_FLAGFILE_BYTES` in all, each checked with
  `os.stat` before it is read.
  """
  return _expand(argv, None, (), [MAX_FLAGFILE_BYTES])


def _expand(
  argv: list[str], including: str | None, seen: tuple, budget: list[int]
) -> list[str]:
  out = []
  args = iter(argv)
  for arg in args:
    if 'flagfile' not in arg:  # most arguments, at once
      out.append(arg)
      continue
    name = None
    for prefix in ('--flagfile=', '-flagfile='):
      if arg.startswith(prefix):
        name = arg[len(prefix) :]
    if arg in ('--flagfile', '-flagfile'):
      name = next(args, '')
    if name is None:
      out.append(arg)
      continue
    path = os.path.realpath(_flagfile_path(name, including))
    if path in seen:
      fail(
        f'--flagfile={errors.clip(name)}: it includes itself '
        f'({errors.clip(path)})'
      )
    lines = _read_flagfile(name, path, budget)
    out += _expand(lines, path, (*seen, path), budget)
  return out


class _Expanded:
  """`flag_values` (absl's FlagValues) parsing arguments whose flagfiles
  `expand_flagfiles` has already replaced: absl's own flagfile pass
  (`read_flags_from_files`) would find none, and it copies the rest of
  the arguments for each one it looks at (quadratic: 70,000 flags took
  12 s), so it is skipped."""

  def __init__(self, flag_values: flags.FlagValues):
    self.flag_values = flag_values

  def __enter__(self) -> None:
    self.flag_values.__dict__['read_flags_from_files'] = (
      lambda argv, force_gnu=True: list(argv)
    )

  def __exit__(self, *exc) -> None:
    self.flag_values.__dict__.pop('read_flags_from_files', None)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with flagfiles found as `expand_flagfiles`
  finds them (in time linear in their size), parse errors as one line,
  and exit code 0 after the help that `--help`, `--helpshort` and
  `--helpfull` ask for (absl exits 1)."""
  argv = [argv[0], *expand_flagfiles(argv[1:])]
  try:
    with _Expanded(flags.FLAGS):
      return flags.FLAGS(argv)
  except flags.Error as e:
    fail(str(e))
  except SystemExit as e:
    # Parsing exits only when a help flag has printed what it asked for.
    sys.exit(0 if e.code == 1 else e.code)


def adopt_program_help(program: str) -> None:
  """Gives the running script the help of the program module `program`.

  absl's help prints the docstring of `__main__` and (`--helpshort`) the
  key flags of the module named `sys.argv[0]`. Under `python -m
  experiments.run` that is the program; under a console script
  (`fedjax-mr-run`) it is a generated wrapper with neither, so the
  wrapper takes the program's docstring and key flags, in which each
  program is named by its console script (`installed_names`).
  """
  module = sys.modules[program]
  main = sys.modules['__main__']
  if module is main:
    return
  main.__doc__ = installed_names(module.__doc__ or '')
  for flag in flags.FLAGS.get_key_flags_for_module(program):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)


# `python -m experiments.<program>` (`.venv/bin/python` too), which works
# only in a checkout.
_IN_CHECKOUT = re.compile(r'\S*python3? -m experiments\.(\w+)')


def installed_names(text: str) -> str:
  """`text` with each `python -m experiments.<program>` replaced by the
  console script that runs `<program>` where the package is installed
  (`fedjax-mr-<program>`, its underscores as hyphens, as pyproject.toml
  names them)."""
  return _IN_CHECKOUT.sub(
    lambda m: 'fedjax-mr-' + m.group(1).replace('_', '-'), text
  )


def no_arguments(argv: list[str]) -> None:
  """Refuses positional arguments (every program takes flags only)."""
  if len(argv) > 1:
    given = errors.clip(' '.join(argv[1:]))
    fail(f'unexpected arguments: {given} (flags are --name=value)')


def guarded(
  main: Callable[[list[str]], object],
) -> Callable[[list[str]], object]:
  """`main` with bad input and unwritable files as one-line errors.

  A `UserError` (a bad flag, file or config) and an `OSError` (a full
  disk, a read-only folder, a file where a folder should be) that reach
  the top end the program with `fail`.
  """
  from fedjax_mr.core import errors

  def wrapped(argv: list[str]) -> object:
    try:
      return main(argv)
    except errors.UserError as e:
      fail(str(e))
    except OSError as e:
      where = f'{e.filename}: ' if e.filename else ''
      fail(f'{where}{e.strerror or e}')

  return wrapped


def _show_warning(message, category, filename, lineno, file=None, line=None):
  """`warnings.showwarning` for the programs: the library's warnings in
  their words (`render`)."""
  del line
  text = warnings.formatwarning(
    render(str(message)), category, filename, lineno, ''
  )
  (file or sys.stderr).write(text)


# The values a config flag allows, by flag (`define_config_flags`,
# `define_algorithm_flags`), for `grouped_help`.
_CHOICES: dict[str, tuple[str, ...]] = {}
# The programs whose `--help` lists their flags by concern: {program
# module: [(heading, [flag, ...]), ...]} (`set_help_groups`).
_HELP_GROUPS: dict[str, list[tuple[str, list[str]]]] = {}
_SHORT_HELP = ('--help', '--helpshort', '-help', '-helpshort', '-h', '-?')


def set_help_groups(program: str, groups: list[tuple[str, list[str]]]) -> None:
  """Makes `--help` (and `--helpshort`) of program module `program` list
  its flags by concern, a line each, under `groups`' headings; the whole
  help of every flag stays under `--helpfull`."""
  _HELP_GROUPS[program] = groups


def config_help_groups(
  fields: Sequence[Any], headings: dict[str, str]
) -> list[tuple[str, list[str]]]:
  """The `set_help_groups` of a config tree's flags (`FlagField`s): the
  flags of each part (`'devices.processes'`) under its heading, in the
  order of `headings` {part: heading}."""
  return [
    (heading, [f.name for f in fields if '.'.join(f.path[:-1]) == part])
    for part, heading in headings.items()
  ]


def grouped_help(doc: str, groups: list[tuple[str, list[str]]]) -> str:
  """A program's `--help`: its docstring, then each group's flags as
  `--name=default  first sentence of the help`, and under a flag that
  takes one of a few values, those values."""
  lines = [doc.strip(), '']
  lines.append(
    'Flags by concern (--helpfull: every flag with its whole help, and '
    "absl's own):"
  )
  for heading, names in groups:
    lines += ['', f'{heading}:']
    for name in names:
      flag = flags.FLAGS[name]
      # A repeatable flag's default is [] (none).
      default = (flag.default_as_str or '').strip("'").removeprefix('[]')
      text = ' '.join((flag.help or '').split())
      first = re.split(r'(?<=[a-z0-9)]\.)\s(?=[A-Z])', text, maxsplit=1)[0]
      line = f'  --{name}={default}  {first}'
      lines.append(line if len(line) <= 80 else line[:79] + '…')
      if name in _CHOICES:  # an enum flag's help starts with <a|b>
        lines += textwrap.wrap(
          'one of: ' + ', '.join(_CHOICES[name]),
          80,
          initial_indent=' ' * 6,
          subsequent_indent=' ' * 8,
          break_on_hyphens=False,
        )
  return '\n'.join(lines) + '\n'


def _print_grouped_help(program: str, argv: list[str]) -> None:
  """Prints `program`'s grouped help and exits 0 when `argv` asks for
  `--help` or `--helpshort` (before `--`) and it has groups."""
  groups = _HELP_GROUPS.get(program)
  args = argv[1 : argv.index('--')] if '--' in argv else argv[1:]
  if groups and any(a in _SHORT_HELP for a in args):
    sys.stdout.write(grouped_help(sys.modules['__main__'].__doc__, groups))
    sys.exit(0)


def run(main: Callable[[list[str]], object]) -> None:
  """`absl.app.run(main)` with one-line errors for unparsable flags, bad
  input and unwritable files (`guarded`), and the library's warnings in
  the program's words (`render`)."""
  warnings.showwarning = _show_warning
  adopt_program_help(main.__module__)

  def parse_then_python_hook(argv: list[str]) -> list[str]:
    _print_grouped_help(main.__module__, argv)
    args = parse_flags(argv)
    sys.excepthook = _python_excepthook  # see `_interrupted_starting`
    if _TERM_AT_START and signal.getsignal(signal.SIGTERM) == (
      _lost_interrupts.on_sigint
    ):
      signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return args

  app.run(guarded(main), flags_parser=parse_then_python_hook)


def define_flag(name: str, f: dataclasses.Field, help_text: str) -> None:
  """An absl flag `--name` of the dataclass field `f`'s type and default
  (a tuple: a comma-separated list)."""
  if str(f.type).startswith('tuple'):
    flags.DEFINE_list(name, list(f.default), help_text)
  elif f.type in ('bool', bool):
    flags.DEFINE_bool(name, f.default, help_text)
  elif f.type in ('int', int):
    flags.DEFINE_integer(name, f.default, help_text)
  elif f.type in ('float', float):
    flags.DEFINE_float(name, f.default, help_text)
  else:
    flags.DEFINE_string(name, f.default, help_text)


def define_config_flags(
  fields: Sequence[Any], choices: Callable[[Any], Any]
) -> list[str]:
  """A flag per field of a config tree (`fedjax_mr.core.config_tree`'s
  `FlagField`s), named, typed and explained by the field, with the values
  `choices(field)` allows (checked where the config is validated, for one
  clear message). Returns their names (a program declares them its key
  flags, which --helpshort lists)."""
  for f in fields:
    help_text = f.metadata['help']
    allowed = choices(f)
    if allowed:
      help_text += f' One of: {", ".join(allowed)}.'
      _CHOICES[f.name] = tuple(allowed)
    define_flag(f.name, f, help_text)
  return [f.name for f in fields]


def define_algorithm_flags() -> list[str]:
  """The algorithms' hyper-parameter flags, from the registry (each help
  text names the algorithms that read it). Returns their names."""
  from fedjax_mr.pipeline import registry

  names = []
  for name, (f, users) in registry.all_flags().items():
    help_text = f'{", ".join(users)}: {f.help}'
    if f.choices:
      help_text += f' One of: {", ".join(f.choices)}.'
      _CHOICES[name] = tuple(f.choices)
    define_flag(name, f, help_text)
    names.append(name)
  return names


def algorithm_options(names: list[str]) -> dict[str, Any]:
  """{flag: value} of the algorithm flags `names` as parsed."""
  return {name: flags.FLAGS[name].value for name in names}
