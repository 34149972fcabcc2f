"""Where and with what a run was made: versions, source commit, devices,
host and start time, recorded beside its results (`config.json`,
`results.json`)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from typing import Any

# Distributions whose versions decide a run's numbers or its files.
PACKAGES = (
  'fedjax_mr',
  'jax',
  'jaxlib',
  'flax',
  'optax',
  'orbax-checkpoint',
  'numpy',
)


def package_versions() -> dict[str, str | None]:
  """`{distribution: version}`; None for one that is not installed."""
  versions = {}
  for name in PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return versions


def source_commit(folder: str | None = None) -> dict[str, Any] | None:
  """The git commit of the checkout holding `folder` (default: this
  package's source) and whether its tracked files differ from it; None
  when it is not a git checkout or git is not installed."""
  folder = folder or os.path.dirname(os.path.abspath(__file__))

  def git(*args):
    return subprocess.run(
      ['git', '-C', folder, *args],
      capture_output=True,
      text=True,
      timeout=10,
      check=True,
    ).stdout.strip()

  try:
    commit = git('rev-parse', 'HEAD')
    # -z: the machine-readable (porcelain) listing, NUL-separated; -uno:
    # tracked files only. Empty when they match the commit.
    changed = git('status', '-z', '-uno')
  except (OSError, subprocess.SubprocessError):
    return None
  return {'commit': commit, 'modified': bool(changed)}


def devices() -> dict[str, Any]:
  """The JAX backend's devices: platform, kind, how many, processes."""
  import jax

  devs = jax.devices()
  return {
    'platform': devs[0].platform,
    'kind': devs[0].device_kind,
    'count': len(devs),
    'processes': jax.process_count(),
  }


def collect(with_devices: bool = True) -> dict[str, Any]:
  """One record of this process: start time (UTC), host, command line,
  Python, package versions, source commit and (if `with_devices`) the
  devices."""
  record = {
    'start_time': datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec='seconds'
    ),
    'host': socket.gethostname(),
    'command': [os.path.basename(sys.argv[0]), *sys.argv[1:]]
    if sys.argv
    else [],
    'python': platform.python_version(),
    'packages': package_versions(),
    'source': source_commit(),
  }
  if with_devices:
    record['devices'] = devices()
  return record
