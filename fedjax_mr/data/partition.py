"""Splitting a training set among simulated clients (host side, seeded).

References:
  Dirichlet label skew as in NIID-Bench (Li et al., "Federated Learning on
  Non-IID Data Silos: An Experimental Study", ICDE 2022) and MOON, which the
  FedMR and FedMut reference code use.
"""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.core import files


def iid(num_examples: int, num_clients: int, seed: int) -> list[np.ndarray]:
  """Equal-size random split (sizes differ by at most one).

  Returns:
    `num_clients` int64 index arrays, disjoint, covering `range(num_examples)`.
  """
  _check_counts(num_examples, num_clients, 1)
  perm = np.random.default_rng(seed).permutation(num_examples)
  return [np.sort(p) for p in np.array_split(perm, num_clients)]


def dirichlet(
  labels: np.ndarray,
  num_clients: int,
  alpha: float,
  seed: int,
  min_size: int = 10,
  max_tries: int = 10_000,
) -> list[np.ndarray]:
  """Dirichlet(α) label-skew partition.

  Repeats, until every client holds at least `min_size` examples: for each
  class, shuffle its indices, draw client proportions p ~ Dir(α·1), zero the
  share of clients that already hold ≥ M/N examples, renormalise and split
  the class's indices at the cumulative proportions. Each client's list is
  shuffled at the end. Small α gives few classes per client; large α tends
  to IID.

  Args:
    labels: `[M]` integer labels.
    num_clients: N.
    alpha: concentration, > 0.
    seed: numpy seed.
    min_size: minimum examples per client.
    max_tries: attempts before giving up with an error.

  Returns:
    `num_clients` index arrays, disjoint and covering `range(M)`.
  """
  labels = np.asarray(labels)
  if not alpha > 0:
    raise errors.ConfigError(f'--alpha must be > 0, got {alpha}')
  _check_counts(len(labels), num_clients, min_size)
  rng = np.random.default_rng(seed)
  m = len(labels)
  cap = m / num_clients
  classes = np.unique(labels)
  by_class = [np.flatnonzero(labels == c) for c in classes]
  for _ in range(max_tries):
    # Per class: the shuffled indices and, for each, the client it goes to
    # (client j gets the j-th contiguous run of the class's indices).
    idx_runs, owner_runs = [], []
    sizes = np.zeros(num_clients, np.int64)
    for members in by_class:
      idx = members.copy()
      rng.shuffle(idx)
      p = rng.dirichlet(np.full(num_clients, alpha))
      p = np.where(sizes < cap, p, 0.0)
      p = p / p.sum()
      cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
      counts = np.diff(np.concatenate([[0], cuts, [len(idx)]]))
      idx_runs.append(idx)
      owner_runs.append(np.repeat(np.arange(num_clients), counts))
      sizes += counts
    if sizes.min() >= min_size:
      idx, owner = np.concatenate(idx_runs), np.concatenate(owner_runs)
      # Stable: each client's examples in the order they were dealt.
      order = np.argsort(owner, kind='stable')
      parts = np.split(idx[order].astype(np.int64), np.cumsum(sizes)[:-1])
      out = []
      for q in parts:
        q = q.copy()
        rng.shuffle(q)
        out.append(q)
      return out
  raise errors.ConfigError(
    f'Dirichlet partition: no split with ≥ {min_size} examples per client '
    f'after {max_tries} tries (alpha={alpha}, {num_clients} clients); use '
    'fewer clients or a larger --alpha'
  )


def _check_counts(num_examples: int, num_clients: int, min_size: int) -> None:
  if num_clients < 1:
    raise errors.ConfigError(f'--num_clients must be ≥ 1, got {num_clients}')
  if num_clients * min_size > num_examples:
    raise errors.ConfigError(
      f'--num_clients={num_clients} with at least {min_size} examples each '
      f'needs {num_clients * min_size} examples; the dataset has '
      f'{num_examples}'
    )


def summary(
  parts: Sequence[np.ndarray], labels: np.ndarray, num_classes: int
) -> dict:
  """Client sizes and per-client label histograms (JSON-serialisable)."""
  labels = np.asarray(labels)
  sizes = [int(len(p)) for p in parts]
  hist = [
    np.bincount(labels[p], minlength=num_classes).astype(int).tolist()
    for p in parts
  ]
  classes_per_client = [int(np.count_nonzero(h)) for h in hist]
  return {
    'num_clients': len(parts),
    'sizes': sizes,
    'size_min': min(sizes),
    'size_max': max(sizes),
    'size_mean': float(np.mean(sizes)),
    'classes_per_client_mean': float(np.mean(classes_per_client)),
    'label_histograms': hist,
  }


def save_summary(path: str, summary_dict: dict) -> None:
  """Writes the summary as JSON, atomically (temporary file, rename)."""
  files.write_atomic(path, lambda f: json.dump(summary_dict, f))
