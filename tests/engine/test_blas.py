"""mlx's CPU matmuls run on an optimized BLAS when one is installed, chosen before mlx loads.

The proof is the dynamic linker's own record (``LD_DEBUG=bindings``) of which library
libmlx's ``cblas_sgemm`` bound to, in a fresh process that did a float32 matmul.
"""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the BLAS swap is Linux-only")

HAS_OPENBLAS = ctypes.util.find_library("openblas") is not None
needs_openblas = pytest.mark.skipif(
    not HAS_OPENBLAS, reason="OpenBLAS missing: apt-get install libopenblas0-pthread"
)

MATMUL = """
import sys
from mlxppd.engine.blas import use_optimized_blas
print(use_optimized_blas(candidates=sys.argv[1:] or ("libopenblas.so.0",)), flush=True)
import mlx.core as mx
a = mx.ones((64, 64), dtype=mx.float32)
mx.eval(a @ a)
"""


def run_matmul(
    *candidates: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run a matmul in a fresh process; return it and the library cblas_sgemm bound to."""
    environ = {**os.environ, "LD_DEBUG": "bindings", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", MATMUL, *candidates],
        capture_output=True,
        text=True,
        env=environ,
        timeout=300,
    )
    bound = [
        line
        for line in proc.stderr.splitlines()
        if "libmlx.so" in line and "`cblas_sgemm'" in line and "binding file" in line
    ]
    return proc, bound[0].split(" to ", 1)[1] if bound else ""


@needs_openblas
def test_libmlx_sgemm_binds_to_openblas() -> None:
    proc, target = run_matmul()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "libopenblas" in target, target
    assert proc.stdout.startswith("OpenBLAS "), proc.stdout
    assert "threads" in proc.stdout


def test_bundled_keeps_the_wheels_reference_blas() -> None:
    proc, target = run_matmul(env={"MLXPP_BLAS": "bundled"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mlx_cpu.libs/libblas-" in target, target
    assert "reference BLAS" in proc.stdout and "MLXPP_BLAS=bundled" in proc.stdout


def test_without_an_optimized_blas_it_warns_once_naming_the_package() -> None:
    proc, target = run_matmul("libno-such-blas.so.0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mlx_cpu.libs/libblas-" in target, target
    warnings = [line for line in proc.stderr.splitlines() if "apt-get install" in line]
    assert len(warnings) == 1 and "libopenblas0-pthread" in warnings[0]
    assert proc.stdout.startswith("reference BLAS")


def test_a_blas_that_cannot_be_opened_is_a_one_line_error(cli_env: dict[str, str]) -> None:
    env = {**cli_env, "MLXPP_BLAS": "/nonexistent/libblas.so"}
    proc = subprocess.run(
        [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "models", "path"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "MLXPP_BLAS" in lines[0] and "/nonexistent/libblas.so" in lines[0]


def test_a_local_clusters_stages_share_the_cores_for_openblas() -> None:
    from mlxppd.runtime.local_cluster import stage_environment

    assert stage_environment({}, stages=2, cpus=8)["OPENBLAS_NUM_THREADS"] == "4"
    assert stage_environment({}, stages=3, cpus=2)["OPENBLAS_NUM_THREADS"] == "1"
    given = {"OPENBLAS_NUM_THREADS": "6", "PATH": "/bin"}
    assert stage_environment(given, stages=2, cpus=8) == given  # the operator's setting wins


def test_a_solo_pass_may_use_every_core_and_idle_threads_sleep() -> None:
    from mlxppd.runtime.local_cluster import stage_environment

    env = stage_environment({}, stages=2, cpus=8)
    assert env["MLXPP_SOLO_THREADS"] == "8" and env["OPENBLAS_THREAD_TIMEOUT"] == "4"


def test_stage_threads_switch_between_the_share_and_solo_in_a_real_openblas() -> None:
    """In a fresh process with OpenBLAS under mlx: a solo pass raises the thread count to the
    solo figure and the next shared pass lowers it again; with no solo figure nothing moves."""
    code = (
        "from mlxppd.engine import blas; blas.use_optimized_blas(); "
        "from mlxppd.engine.stage_threads import StageThreads; "
        "get = blas._lib.openblas_get_num_threads; "
        "t = StageThreads({'OPENBLAS_NUM_THREADS': '1', 'MLXPP_SOLO_THREADS': '2'}); "
        "t.before_pass(True); a = get(); t.before_pass(False); b = get(); "
        "off = StageThreads({'OPENBLAS_NUM_THREADS': '1'}); off.before_pass(True); "
        "print(a, b, get(), t.enabled, off.enabled)"
    )
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "MLXPP_BLAS": "auto"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["2", "1", "1", "True", "False"]
