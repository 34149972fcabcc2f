"""Flower's `flower-supernode`, beating at a heartbeat interval of its own
and asking for messages at a poll interval of its own.

A SuperNode tells the SuperLink that it is alive every so often, and
the SuperLink counts it offline (and answers the messages it holds for
it with an error, which fails the node's clients of the round) once two
of its intervals pass without a beat. Flower 1.42 fixes the interval a
SuperNode asks for at 30 s, so a node that dies fails its clients up to
a minute later. The SuperLink accepts 10 s to 30 min.

A SuperNode with no message to run asks the SuperLink again 3 s later
(Flower 1.42), and waits for its App's reply in steps of 0.5 s: every
message of a round waits 1.5 s on average before a node sees it. On one
machine (`federation.Federation`, the local federation) asking every
0.25 s costs nothing worth counting.

`python -m fedjax_mr.deploy.flower.supernode`, its own options first
(two dashes, as Flower's own options): `heartbeat-interval S`,
`poll-interval P` or both, and then the arguments of `flower-supernode`,
is `flower-supernode` beating every S seconds and waiting at most P
seconds between looks (`federation.Federation`'s `heartbeat_s` and
`poll_s` start its nodes so; docs/howto/deploy.md has a real fleet's
command line). It leans on names inside Flower (the interval the fleet
connection sends and the one its heartbeat thread waits by; the clock of
the node's message loop), pinned with Flower's version (pyproject.toml);
`flower-supernode` itself is the way back.
"""

from __future__ import annotations

import sys
import time

from flwr.common import constant as flwr_constant
from flwr.supercore import heartbeat
from flwr.supernode import fleet_http_connection
from flwr.supernode import start_client_internal
from flwr.supernode.cli.flower_supernode import flower_supernode

OPTION = '-' * 2 + 'heartbeat-interval'  # Flower's spelling
POLL_OPTION = '-' * 2 + 'poll-interval'
# The shortest poll interval: 20 looks a second at most.
POLL_MIN_S = 0.05
MIN_S = flwr_constant.HEARTBEAT_MIN_INTERVAL
MAX_S = flwr_constant.HEARTBEAT_MAX_INTERVAL


def check_interval(seconds: float) -> float:
  """`seconds` if the SuperLink accepts it as a heartbeat interval.

  Raises:
    ValueError: outside [MIN_S, MAX_S].
  """
  if not MIN_S <= seconds <= MAX_S:
    raise ValueError(
      f'heartbeat interval {seconds} s: the SuperLink accepts '
      f'{MIN_S} s to {MAX_S} s'
    )
  return float(seconds)


def set_interval(seconds: float) -> None:
  """Makes this process's SuperNode ask for, and beat at, `seconds`."""
  seconds = check_interval(seconds)
  # What the node sends when it activates and with each beat (the
  # SuperLink's patience is counted in it) ...
  fleet_http_connection.HEARTBEAT_DEFAULT_INTERVAL = seconds
  # ... and what its heartbeat thread waits by between beats.
  heartbeat.HEARTBEAT_DEFAULT_INTERVAL = seconds


class _Clock:
  """The `time` module of the node's message loop, whose waits last at
  most `poll_s` seconds."""

  def __init__(self, poll_s: float):
    self.poll_s = poll_s

  def __getattr__(self, name):
    return getattr(time, name)

  def sleep(self, seconds: float) -> None:
    time.sleep(min(seconds, self.poll_s))


def set_poll(seconds: float) -> None:
  """Makes this process's SuperNode wait at most `seconds` between two
  looks for a message (and for its App's reply).

  Raises:
    ValueError: below POLL_MIN_S, above Flower's own 3 s, or not a number.
  """
  if not POLL_MIN_S <= seconds <= 3:
    raise ValueError(
      f"poll interval {seconds} s: from {POLL_MIN_S} s to 3 s (Flower's own)"
    )
  start_client_internal.time = _Clock(float(seconds))


def main() -> None:
  args = sys.argv[1:]
  setters = {OPTION: set_interval, POLL_OPTION: set_poll}
  usage = (
    f'usage: {sys.argv[0]} [{OPTION} SECONDS] [{POLL_OPTION} SECONDS] '
    '<flower-supernode arguments>'
  )
  given = []
  while args and args[0] in setters:
    if len(args) < 2 or args[0] in given:
      sys.exit(usage)
    given.append(args[0])
    try:
      setters[args[0]](float(args[1]))
    except ValueError as e:
      sys.exit(f'{args[0]}: {e}')
    args = args[2:]
  if not given:
    sys.exit(usage)
  sys.argv = ['flower-supernode', *args]
  sys.exit(flower_supernode())


if __name__ == '__main__':
  main()
