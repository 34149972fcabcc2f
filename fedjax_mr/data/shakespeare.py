"""Shakespeare from Gutenberg's 1994 text, converted as LEAF converts it.

`convert` writes LEAF's Shakespeare json (`leaf`) from Project
Gutenberg's etext 100 of January 1994, as LEAF's
`data/shakespeare/preprocess` scripts do: the plays are split into the
lines each character speaks (`parse_plays`, LEAF's
`preprocess_shakespeare.py`), each character of a play with more than two
lines is a user (`user_lines`), and a user's samples are every window of
80 characters and the character after it (`windows`), split by
`leaf.train_mask`. Users are in text order, not shuffled.

References:
  Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018.
  McMahan et al., "Communication-Efficient Learning of Deep Networks from
  Decentralized Data", AISTATS 2017 (the dataset).
"""

from __future__ import annotations

import collections
import json
import os
import random
import re

import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.data import download
from fedjax_mr.data import leaf

# Project Gutenberg's etext 100 of January 1994 (its file 100.txt), which
# LEAF's shakespeare/preprocess/get_data.sh gets and whose layout its parser
# expects; Gutenberg has since moved it from old/ to old/old/.
GUTENBERG_1994 = download.Source(
  (
    'https://www.gutenberg.org/files/100/old/old/1994-01-100.zip',
    'http://www.gutenberg.org/files/100/old/1994-01-100.zip',
  ),
  '1994-01-100.zip',
)
SOURCES = (GUTENBERG_1994,)

# LEAF's preprocess_shakespeare.py (from Google's, for the 1994 text).
_CHARACTER_RE = re.compile(r'^  ([a-zA-Z][a-zA-Z ]*)\. (.*)')
_CONT_RE = re.compile(r'^    (.*)')
# "The Comedy of Errors" is indented differently.
_COE_CHARACTER_RE = re.compile(r'^([a-zA-Z][a-zA-Z ]*)\. (.*)')
_COE_CONT_RE = re.compile(r'^(.*)')
_AUTHOR = 'by William Shakespeare'
_LAST_LINE = 124195  # where the plays end in the 1994 text
_SPACES = re.compile(r'  +')


def parse_plays(text: str) -> list[tuple[str, dict[str, list[str]]]]:
  """LEAF's `_split_into_plays`: (title, {character: lines}) of each play
  of Gutenberg's 1994 complete works (sonnets and poems are skipped), in
  text order; plays with fewer than two characters are dropped."""
  lines = text.splitlines(True)[1:]
  count, start = 0, 0
  for i, line in enumerate(lines):
    count += _AUTHOR in line
    if count == 2:  # the first play
      start = i - 5
      break
  lines = lines[start:]
  plays = []
  characters: dict[str, list[str]] | None = None
  current = None
  comedy_of_errors = False
  for i, line in enumerate(lines):
    if i > _LAST_LINE - start:
      break
    if _AUTHOR in line:
      current = None
      characters = collections.defaultdict(list)
      title = _title(lines, i, start)
      comedy_of_errors = title == 'THE COMEDY OF ERRORS'
      plays.append((title, characters))
      continue
    if characters is None:
      continue
    match = (_COE_CHARACTER_RE if comedy_of_errors else _CHARACTER_RE).match(
      line
    )
    if match:
      character, snippet = match.group(1).upper(), match.group(2)
      if comedy_of_errors and character.startswith('ACT '):
        current = None
      else:
        characters[character].append(snippet)
        current = character
      continue
    if current:
      match = (_COE_CONT_RE if comedy_of_errors else _CONT_RE).match(line)
      if match:
        if comedy_of_errors and match.group(1).startswith('<'):
          current = None
        else:
          characters[current].append(match.group(1))
  return [play for play in plays if len(play[1]) > 1]


def _title(lines: list[str], i: int, start: int) -> str:
  """The title of the play whose author line is `lines[i]`: the nearest
  non-blank one of the five lines above the line above it, else the line
  above those (`lines[0]` is line `start` + 2 of the text, for the
  message)."""
  title = next(
    (lines[i - k] for k in range(2, 7) if lines[i - k].strip()),
    lines[i - 7],
  ).strip()
  if not title:
    raise errors.DataError(
      f'line {start + i + 2}: no play title above "{_AUTHOR}" (not '
      "Gutenberg's 1994 text of Shakespeare?)"
    )
  return title


def user_lines(
  plays: list[tuple[str, dict[str, list[str]]]],
) -> dict[str, list[str]]:
  """User (`<PLAY>_<CHARACTER>`, non-word runs as '_') → the lines the
  character speaks, for characters with more than two lines (LEAF's
  `_get_train_test_by_character` with no test fraction)."""
  users: dict[str, list[str]] = collections.defaultdict(list)
  for title, characters in plays:
    for character, lines in characters.items():
      if len(lines) > 2:
        name = re.sub(r'\W+', '_', f'{title}_{character}'.replace(' ', '_'))
        users[name].extend(lines)
  return users


def clean_lines(spoken: list[str]) -> list[str]:
  """LEAF's lines of one user (`shake_utils.py`): each line with its
  newline, runs of two or more spaces as one."""
  return [_SPACES.sub(' ', line + '\n') for line in spoken]


def windows(lines: list[str]) -> tuple[list[str], list[str]]:
  """LEAF's samples of one user: for each line, padded on the left with 80
  spaces, every window of 80 characters and the character after it."""
  xs, ys = [], []
  pad = ' ' * leaf.SEQ_LEN
  for line in lines:
    padded = pad + line
    xs += [padded[i : i + leaf.SEQ_LEN] for i in range(len(line))]
    ys += list(line)
  return xs, ys


def _read_gutenberg(path: str) -> str:
  """The text of 100.txt (or of the one .txt file) in the Gutenberg zip,
  newlines as '\\n' (as LEAF's reading it in text mode gives them)."""
  with download.open_zip(path) as z:
    names = [n for n in z.namelist() if n.lower().endswith('.txt')]
    names = [n for n in names if os.path.basename(n) == '100.txt'] or names
    if len(names) != 1:
      raise errors.DataError(
        f'{path}: expected 100.txt (or one .txt file), found '
        f'{", ".join(names) or "none"}'
      )
    raw = z.read(names[0])
  text = raw.decode('latin-1')
  return text.replace('\r\n', '\n').replace('\r', '\n')


def _users(path: str) -> dict[str, list[str]]:
  """User → LEAF's lines (`clean_lines`) of the Gutenberg zip at `path`.

  Raises:
    DataError: no play, or a character outside LEAF's vocabulary.
  """
  users = user_lines(parse_plays(_read_gutenberg(path)))
  if not users:
    raise errors.DataError(
      f"{path}: no play found (not Gutenberg's 1994 text of Shakespeare?)"
    )
  lines = {u: clean_lines(spoken) for u, spoken in users.items()}
  outside = set(''.join(''.join(v) for v in lines.values())) - set(
    leaf.ALL_LETTERS
  )
  if outside:
    raise errors.DataError(
      f"{path}: characters outside LEAF's 80-letter vocabulary: "
      f'{sorted(outside)!r}'
    )
  return lines


def convert(path: str, out: str, train_fraction: float, seed: int) -> None:
  """Writes LEAF's Shakespeare json into `out`/train and `out`/test, one
  file each, from the Gutenberg zip at `path`."""
  lines = _users(path)
  rng = random.Random(seed)
  masks = {}
  for user, text in lines.items():
    mask = leaf.train_mask(sum(map(len, text)), train_fraction, rng)
    if mask is not None:
      masks[user] = mask
  names = list(masks)
  for split, keep in (('train', True), ('test', False)):
    os.makedirs(os.path.join(out, split))

    def rows(keep=keep):
      for user in names:
        xs, ys = windows(lines[user])
        take = np.flatnonzero(masks[user] == keep)
        yield (
          user,
          json.dumps([xs[j] for j in take]),
          json.dumps([ys[j] for j in take]),
        )

    leaf.write_json(
      os.path.join(out, split, f'all_data_{split}.json'),
      names,
      [int((masks[u] == keep).sum()) for u in names],
      rows(),
    )
