#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh), then run every check CI runs: ruff, mypy, the import-layer
# contract, the schema freshness check and the pytest suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1  # tests never download from a model hub
V=.venv/bin
echo "== ruff" >&2;          $V/ruff check . && $V/ruff format --check .
echo "== mypy" >&2;          $V/mypy
echo "== import layers" >&2; $V/lint-imports
echo "== schemas" >&2;       $V/python scripts/gen_schemas.py --check
echo "== pytest" >&2
set +e
$V/python -m pytest "$@"
rc=$?
if [ "$rc" = 0 ] && [ "$#" = 0 ]; then
  # mlxppd runs on uvloop where it is installed; the wire must work on asyncio's loop too.
  echo "== pytest: wire tests on asyncio's event loop" >&2
  MLXPP_EVENT_LOOP=asyncio $V/python -m pytest -q tests/test_wire_*.py tests/test_discovery.py
  rc=$?
fi
set -e
# pytest's 5 means it collected no test: that is a failure, never a pass.
[ "$rc" = 5 ] && echo "test: pytest ran no test" >&2 && exit 1
exit "$rc"
