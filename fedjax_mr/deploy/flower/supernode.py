"""Flower's `flower-supernode`, beating at a heartbeat interval of its own.

A SuperNode tells the SuperLink that it is alive every so often, and
the SuperLink counts it offline (and answers the messages it holds for
it with an error, which fails the node's clients of the round) once two
of its intervals pass without a beat. Flower 1.42 fixes the interval a
SuperNode asks for at 30 s, so a node that dies fails its clients up to
a minute later. The SuperLink accepts 10 s to 30 min.

`python -m fedjax_mr.deploy.flower.supernode`, its first option
`heartbeat-interval S` (two dashes, as Flower's own options) and then
the arguments of `flower-supernode`, is `flower-supernode` asking for S
seconds (`federation.Federation`'s `heartbeat_s` starts its nodes so;
docs/howto/deploy.md has a real fleet's command line). It leans on two
names inside Flower (the interval the fleet connection sends and the
one its heartbeat thread waits by), pinned with Flower's version
(pyproject.toml); `flower-supernode` itself is the way back.
"""

from __future__ import annotations

import sys

from flwr.common import constant as flwr_constant
from flwr.supercore import heartbeat
from flwr.supernode import fleet_http_connection
from flwr.supernode.cli.flower_supernode import flower_supernode

OPTION = '-' * 2 + 'heartbeat-interval'  # Flower's spelling
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


def main() -> None:
  args = sys.argv[1:]
  if len(args) < 2 or args[0] != OPTION:
    sys.exit(
      f'usage: {sys.argv[0]} {OPTION} SECONDS <flower-supernode arguments>'
    )
  try:
    set_interval(float(args[1]))
  except ValueError as e:
    sys.exit(f'{OPTION}: {e}')
  sys.argv = ['flower-supernode', *args[2:]]
  sys.exit(flower_supernode())


if __name__ == '__main__':
  main()
