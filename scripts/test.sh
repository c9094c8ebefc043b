#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh), then run every check CI runs: ruff, mypy, the import-layer
# contract, the schema freshness check and the pytest suite. Extra arguments go to pytest.
# Some tests need system packages: promtool (Debian: prometheus) checks the alert rules,
# libsystemd-dev + pkg-config (and a C compiler) build systemd-python, the mlxpp[systemd] extra,
# and chromium runs the web console's tests.
# As root on Debian this installs what is missing; elsewhere it says what to install and those
# tests skip, naming the package.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v promtool >/dev/null || missing+=(prometheus)
command -v pkg-config >/dev/null || missing+=(pkg-config)
pkg-config --exists libsystemd 2>/dev/null || missing+=(libsystemd-dev)
command -v cc >/dev/null || missing+=(gcc)
# The web console's tests drive a real headless Chromium; DejaVu gives its screenshots text.
command -v chromium >/dev/null || missing+=(chromium)
[ -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || missing+=(fonts-dejavu-core)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test: installing ${missing[*]} with apt-get" >&2
    apt-get update -qq
    # --no-install-recommends: prometheus alone, not its exporters and web UI.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
    promtool --version >/dev/null  # the tests run it; fail here rather than skip there
    command -v chromium >/dev/null
  else
    echo "test: missing ${missing[*]} (Debian: sudo apt-get install ${missing[*]});" \
         "the tests that need them will skip" >&2
  fi
fi

bash scripts/setup.sh
if pkg-config --exists libsystemd 2>/dev/null; then
  # setup.sh installs mlxpp[test]; the journald and sd_notify tests also want systemd-python.
  if ! .venv/bin/python -m pip --disable-pip-version-check install -q -e ".[test,systemd]"; then
    echo "test: systemd-python did not build (it needs Python's headers too: Debian" \
         "python3-dev); its tests will skip" >&2
  fi
fi
export HF_HUB_OFFLINE=1  # tests never download from a model hub
# Two workers share two cores: one OpenBLAS thread per process (idle OpenBLAS threads spin,
# which cost a quarter of the suite's CPU when every process had one per core).
export OPENBLAS_NUM_THREADS=1
V=.venv/bin
# The static checks, and the wire tests on asyncio's event loop, run beside the main pytest run
# (one process mostly, while the tests mostly wait on the clusters they start); their output
# is printed after it, and any failure fails the command.
side_log=$(mktemp)
(
  set -e
  echo "== ruff";          $V/ruff check . && $V/ruff format --check .
  echo "== mypy";          $V/mypy
  echo "== import layers"; $V/lint-imports
  echo "== schemas";       $V/python scripts/gen_schemas.py --check
  echo "== openapi";       $V/python scripts/gen_openapi.py --check
  if [ "$#" = 0 ]; then
    # mlxppd runs on uvloop where it is installed; the wire must work on asyncio's loop too.
    echo "== pytest: wire tests on asyncio's event loop"
    MLXPP_EVENT_LOOP=asyncio $V/python -m pytest -q -p no:cacheprovider \
      tests/wire/test_wire_*.py tests/wire/test_discovery.py tests/wire/test_noise.py \
      tests/wire/test_node_identity.py tests/wire/test_handshake_hostile.py tests/wire/test_rekey.py
  fi
) >"$side_log" 2>&1 &
side=$!
echo "== pytest (static checks and asyncio wire tests beside it, reported after)" >&2
set +e
# Three workers, one test file each at a time (--dist loadfile: a file's module fixtures, its
# clusters, are built once). A cluster test keeps about one core busy (its pipeline's stages
# take turns) and often waits on a heartbeat or a restart: on two cores two workers left a
# fifth of the CPU idle, a third fills it. Each worker gets its own local-cluster port range
# (tests/conftest.py). The slowest files go first, in tests/conftest.py's order
# (SLOW_MODULES), not xdist's.
$V/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder "$@"
rc=$?
wait "$side"
side_rc=$?
cat "$side_log" >&2
rm -f "$side_log"
set -e
# pytest's 5 means it collected no test: that is a failure, never a pass.
[ "$rc" = 5 ] && echo "test: pytest ran no test" >&2 && exit 1
if [ "$side_rc" != 0 ]; then
  echo "test: a static check or the asyncio wire tests failed (output above)" >&2
  exit "$side_rc"
fi
exit "$rc"
