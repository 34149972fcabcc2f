"""The watchdog: a program killed with SIGKILL leaves no process of its
group, or marked by it, behind."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from fedjax_mr.core import watchdog


def group_members(pgid):
  """The live members of process group `pgid` (tests/deploy's too)."""
  found = []
  for entry in os.listdir('/proc'):
    if entry.isdigit():
      try:
        with open(f'/proc/{entry}/stat', 'rb') as f:
          fields = f.read().rsplit(b')', 1)[1].split()
      except OSError:
        continue
      if int(fields[2]) == pgid and fields[0] != b'Z':
        found.append(int(entry))
  return found


def test_the_watchdog_stops_the_group_when_its_parent_is_killed(tmp_path):
  # The parent starts the watchdog, a process in its group and one that
  # leaves it for a session of its own (as Flower's SuperLink starts its
  # SuperExec) with the program's mark, and leaves its last words (a
  # command that reads its environment), then waits to be killed with
  # SIGKILL, which it cannot handle. The parent waits for the process that
  # leaves to say it is up: Popen returns once exec has begun, when the new
  # program's environment may not be readable yet (/proc/PID/environ empty).
  # That process execs nothing after it says so (`bash -c "...; sleep 600"`
  # exec'd sleep after its echo: the same window, which a fresh clone of
  # b28abb6 hit).
  last, said = str(tmp_path / 'last.json'), str(tmp_path / 'said')
  parent = subprocess.Popen(
    [
      sys.executable,
      '-c',
      textwrap.dedent(
        """
        import os, subprocess, sys, time
        from fedjax_mr.core import watchdog
        last, said = sys.argv[1:]
        dog = subprocess.Popen(
          [sys.executable, '-m', watchdog.__name__, str(os.getpid()), 'M1',
           last], process_group=0)
        watchdog.write_last_words(last, ['false'])
        watchdog.write_last_words(
          last, ['bash', '-c', f'echo "$WORD" > {said}'], {'WORD': 'bye'})
        env = {**os.environ, watchdog.MARK_VARIABLE: 'M1'}
        child = subprocess.Popen(['sleep', '600'], process_group=dog.pid)
        away = subprocess.Popen(
          [sys.executable, '-c', 'import signal, time; '
           'signal.signal(signal.SIGTERM, signal.SIG_IGN); '
           'print("up", flush=True); time.sleep(600)'], env=env,
          start_new_session=True, stdout=subprocess.PIPE, text=True)
        assert away.stdout.readline().strip() == 'up'
        print(dog.pid, child.pid, away.pid, flush=True)
        time.sleep(600)
        """
      ),
      last,
      said,
    ],
    stdout=subprocess.PIPE,
    text=True,
  )
  group, child, away = map(int, parent.stdout.readline().split())
  assert child in group_members(group)
  assert away in watchdog._members(group, 'M1')
  assert not os.path.exists(said)
  parent.send_signal(signal.SIGKILL)
  parent.wait()
  deadline = time.monotonic() + 60
  while watchdog._members(group, 'M1') and time.monotonic() < deadline:
    time.sleep(0.2)
  assert watchdog._members(group, 'M1') == []
  # The last words were said (their latest version) before the group went.
  with open(said) as f:
    assert f.read() == 'bye\n'
  assert (
    not os.path.exists(f'/proc/{away}')
    or open(f'/proc/{away}/stat').read().rsplit(')', 1)[1].split()[0] == 'Z'
  )
