"""Stops a federation's processes when the program that started them ends.

`python -m fedjax_mr.deploy.watchdog PARENT_PID` is started first, as the
leader of a new process group; every process of the federation joins that
group. The watchdog polls its parent: when the parent is gone (it ended,
or was killed with SIGKILL, which no handler sees), it sends the whole
group SIGTERM, then SIGKILL after a grace period. A program that ends
normally stops the group itself (`federation.Federation.stop`). Host-only:
never imports jax or flwr, so it starts at once.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.5
GRACE_S = 10.0


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


def stop_group(pgid: int, grace_s: float = GRACE_S) -> None:
  """SIGTERM to process group `pgid`, SIGKILL to what is left after
  `grace_s` seconds (the caller, if a member, ignores the SIGTERM)."""
  try:
    os.killpg(pgid, signal.SIGTERM)
  except ProcessLookupError:
    return
  deadline = time.monotonic() + grace_s
  while time.monotonic() < deadline:
    if not _others_in_group(pgid):
      break
    time.sleep(0.1)
  try:
    os.killpg(pgid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def _others_in_group(pgid: int) -> bool:
  me = os.getpid()
  for entry in os.listdir('/proc'):
    # The leader (the watchdog) goes with the final SIGKILL.
    if not entry.isdigit() or int(entry) in (me, pgid):
      continue
    try:
      with open(f'/proc/{entry}/stat', 'rb') as f:
        fields = f.read().rsplit(b')', 1)[1].split()
    except OSError:
      continue
    # Fields after the name: state, ppid, pgrp; zombies are already gone.
    if int(fields[2]) == pgid and fields[0] != b'Z':
      return True
  return False


def main(argv: list[str]) -> int:
  parent = int(argv[1])
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  while _alive(parent):
    time.sleep(POLL_S)
  stop_group(os.getpgid(0))
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
