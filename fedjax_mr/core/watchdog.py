"""Stops a group of processes when the program that started them ends.

`python -m fedjax_mr.core.watchdog PARENT_PID MARK` is started first, as
the leader of a new process group; every process the program starts joins
that group, and carries `MARK` in its environment (`MARK_VARIABLE`), which
its children inherit: a process that leaves the group for a session of its
own (Flower's SuperLink starts its SuperExec, and so the ServerApp, so) is
found by the mark. The watchdog polls its parent: when the parent is gone
(it ended, or was killed with SIGKILL, which no handler sees), it sends
the group and every marked process SIGTERM, then SIGKILL after a grace
period. A program that ends normally stops them itself (`stop_group`; the
local Flower federation, `fedjax_mr.deploy.federation`, does both).
Host-only and standard library only, so it starts at once.

`python -m fedjax_mr.core.watchdog PARENT_PID MARK LAST_WORDS` runs, when
the parent is gone and before the group is stopped, the command that file
`LAST_WORDS` holds at that moment, if any (`write_last_words`: what the
program would have done on its way out, such as stopping a run it started
on another machine); the command has LAST_TIMEOUT_S seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5
GRACE_S = 10.0
LAST_TIMEOUT_S = 60.0


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  # A parent that ended but was not reaped still answers; its children
  # were then re-parented, ours included.
  return os.getppid() == pid


MARK_VARIABLE = 'FEDJAX_MR_FEDERATION'


def _signal(pgid: int, mark: str | None, signum: int) -> None:
  # The members one by one first: the group's signal may end the caller
  # (the watchdog, when it is SIGKILL).
  for pid in _members(pgid, mark):
    try:
      os.kill(pid, signum)
    except ProcessLookupError:
      pass
  try:
    os.killpg(pgid, signum)
  except ProcessLookupError:
    pass


def stop_group(
  pgid: int, mark: str | None = None, grace_s: float = GRACE_S
) -> None:
  """SIGTERM to process group `pgid` and the processes marked `mark`,
  SIGKILL to what is left after `grace_s` seconds (the caller, if one of
  them, and the group's leader, the watchdog, ignore the SIGTERM)."""
  _signal(pgid, mark, signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  while time.monotonic() < deadline and _members(pgid, mark):
    time.sleep(0.1)
  _signal(pgid, mark, signal.SIGKILL)


def _members(pgid: int, mark: str | None) -> list[int]:
  """The live processes of group `pgid` or marked `mark`, but this one
  and the group's leader (the watchdog: it goes with the last SIGKILL)."""
  me = os.getpid()
  marked = None if mark is None else f'{MARK_VARIABLE}={mark}'.encode()
  found = []
  for entry in os.listdir('/proc'):
    if not entry.isdigit() or int(entry) in (me, pgid):
      continue
    try:
      with open(f'/proc/{entry}/stat', 'rb') as f:
        fields = f.read().rsplit(b')', 1)[1].split()
      # Fields after the name: state, ppid, pgrp; zombies are gone.
      if fields[0] == b'Z':
        continue
      if int(fields[2]) == pgid:
        found.append(int(entry))
        continue
      if marked is not None:
        with open(f'/proc/{entry}/environ', 'rb') as f:
          if marked in f.read().split(b'\0'):
            found.append(int(entry))
    except (OSError, IndexError, ValueError):
      continue
  return found


def write_last_words(
  path: str, argv: list[str] | None, env: dict[str, str] | None = None
) -> None:
  """Makes `argv` (with `env` added to the watchdog's environment) the
  command the watchdog reading `path` runs when its parent is gone;
  None: no command. Atomic (the watchdog may read it at any moment)."""
  if argv is None:
    if os.path.exists(path):
      os.remove(path)
    return
  part = f'{path}.{os.getpid()}.part'
  with open(part, 'w') as f:
    json.dump({'argv': list(argv), 'env': dict(env or {})}, f)
  os.replace(part, path)


def _last_words(path: str) -> None:
  """Runs the command in `path` (`write_last_words`), if there is one."""
  try:
    with open(path) as f:
      words = json.load(f)
    argv, env = list(words['argv']), dict(words['env'])
  except (OSError, ValueError, KeyError, TypeError):
    return
  try:
    subprocess.run(
      argv,
      stdin=subprocess.DEVNULL,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
      env={**os.environ, **env},
      timeout=LAST_TIMEOUT_S,
    )
  except (OSError, subprocess.SubprocessError):
    pass


def main(argv: list[str]) -> int:
  parent, mark = int(argv[1]), argv[2]
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  while _alive(parent):
    time.sleep(POLL_S)
  if len(argv) > 3:
    _last_words(argv[3])
  stop_group(os.getpgid(0), mark)
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
