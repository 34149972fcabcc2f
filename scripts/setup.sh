#!/usr/bin/env bash
# Installs fedjax_mr into ./.venv (with the test extra) and, when missing,
# Debian's Fashion-MNIST IDX files (the embedded default dataset).
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# Strict editable mode: the package is a tree of links to the checkout's
# files on sys.path, so a script beside the clone's folder (which has no
# __init__.py) still imports the package, not that folder (BUILD.md). The
# tree links the files there were at install time: install again when
# pyproject.toml or the list of the package's files changes.
STAMP=$( (cat pyproject.toml; find fedjax_mr experiments -name '*.py' -o -name '*.flags' | LC_ALL=C sort) | sha256sum)
if ! .venv/bin/python -c 'import fedjax_mr, jax, flax, optax, orbax.checkpoint, tensorflow_datasets, pytest' 2>/dev/null \
  || [ "$(cat .venv/.installed 2>/dev/null)" != "$STAMP" ]; then
  # uv resolves, downloads and unpacks the wheels in a quarter of pip's
  # time (a fresh clone's set-up: 10 s against 39 s, AMD EPYC; Python
  # writes the bytecode at the first import, not at install) and installs
  # the same versions; UV_NATIVE_TLS: the system's certificates, as pip.
  # pip where uv cannot be installed or fails.
  if ! { .venv/bin/python -m pip install --quiet --disable-pip-version-check 'uv>=0.9' \
    && UV_NATIVE_TLS=1 .venv/bin/python -m uv pip install --quiet \
      --python .venv/bin/python -e '.[test]' \
      --config-settings editable_mode=strict; }; then
    echo 'uv failed: installing with pip' >&2
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e '.[test]' \
      --config-settings editable_mode=strict
  fi
  echo "$STAMP" > .venv/.installed
fi

FMNIST=/usr/share/datasets/fashion-mnist
if [ ! -f "$FMNIST/train-images-idx3-ubyte.gz" ]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=''
    if [ "$(id -u)" != 0 ]; then SUDO='sudo'; fi
    echo 'installing dataset-fashion-mnist (Debian) ...'
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null
  else
    echo "warning: $FMNIST is missing and apt-get is not available;" \
      'pass --data_dir to a folder with the Fashion-MNIST IDX files' >&2
  fi
fi
