"""Which BLAS MLX's CPU backend runs on, and putting an optimized one under it on Linux.

The ``mlx[cpu]`` Linux wheel links ``libmlx.so`` against the netlib *reference* BLAS and LAPACK
it bundles (``mlx_cpu.libs/libblas-*.so``): a float32 matmul runs about 70x slower there than on
OpenBLAS. A library opened with ``RTLD_GLOBAL`` joins the process's global symbol scope, which
the dynamic linker searches before a library's own dependencies, so once OpenBLAS is opened that
way *before mlx is first imported*, libmlx's ``cblas_sgemm`` and LAPACK calls bind to it. No
environment variable, re-exec or patched wheel is needed; every entry point (``mlxppd``, the
benchmarks, the test suite) calls :func:`use_optimized_blas` before it imports mlx.

``MLXPP_BLAS`` chooses: ``auto`` (default: Debian's ``libopenblas.so.0`` where installed),
``bundled`` (keep the wheel's reference BLAS) or a library name/path to open instead.
macOS is untouched: mlx there runs on Accelerate and Metal.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mlxppd.core.errors import ConfigurationError

log = logging.getLogger("mlxppd.blas")

ENV = "MLXPP_BLAS"
#: sonames tried in order by ``auto``; Debian's alternatives point the first at the
#: pthread, openmp or serial build, whichever is installed
_CANDIDATES = ("libopenblas.so.0", "libopenblas.so")
#: the Debian package that brings an optimized BLAS, named in the fallback warning
DEBIAN_PACKAGE = "libopenblas0-pthread"
_REFERENCE = "reference BLAS bundled with mlx[cpu] (slow: float32 matmul ~70x below OpenBLAS)"


@dataclass(frozen=True)
class BlasInUse:
    """The BLAS under MLX's CPU matmuls in this process."""

    name: str
    """what it is, for logs and ``mlxppctl status``"""
    optimized: bool
    """True unless it is the wheel's reference BLAS"""

    def __str__(self) -> str:
        return self.name


_chosen: BlasInUse | None = None
#: the opened OpenBLAS, whose thread count ``set_threads`` changes
_lib: ctypes.CDLL | None = None


def blas_in_use() -> BlasInUse:
    """What :func:`use_optimized_blas` put in place (the platform default when never called)."""
    if _chosen is not None:
        return _chosen
    if sys.platform != "linux":
        return BlasInUse("Accelerate (the platform's own)", optimized=True)
    return BlasInUse(_REFERENCE, optimized=False)


def _describe(lib: ctypes.CDLL, soname: str) -> str:
    """OpenBLAS names its version, kernels and threads; anything else is named by its file."""
    try:
        lib.openblas_get_config.restype = ctypes.c_char_p
        lib.openblas_get_corename.restype = ctypes.c_char_p
        config = (lib.openblas_get_config() or b"").decode(errors="replace").split()
        core = (lib.openblas_get_corename() or b"?").decode(errors="replace")
        threads = int(lib.openblas_get_num_threads())
    except AttributeError:
        return soname
    version = " ".join(config[:2]) if config else "OpenBLAS"
    return f"{version} ({soname}, {core} kernels, {threads} threads)"


def _open(soname: str) -> BlasInUse | None:
    try:
        lib = ctypes.CDLL(soname, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    if not hasattr(lib, "cblas_sgemm"):
        raise ConfigurationError(
            f"{soname} has no cblas_sgemm, so it cannot stand in for mlx's BLAS; "
            f"point {ENV} at an OpenBLAS build or set {ENV}=bundled",
            source=ENV,
        )
    global _lib
    _lib = lib
    return BlasInUse(_describe(lib, soname), optimized=True)


def set_threads(count: int) -> bool:
    """Have the opened OpenBLAS use ``count`` threads from its next call; False when there is
    none to tell (the bundled BLAS, macOS)."""
    setter = getattr(_lib, "openblas_set_num_threads", None) if _lib is not None else None
    if setter is None:
        return False
    setter(ctypes.c_int(count))
    return True


def use_optimized_blas(
    environ: Mapping[str, str] | None = None, candidates: Sequence[str] = _CANDIDATES
) -> BlasInUse:
    """Open an optimized BLAS for mlx if this platform needs one; idempotent.

    Falls back to the bundled reference BLAS with one warning naming the package to install.
    Must run before ``import mlx.core``; called later it only reports what is in place.
    """
    global _chosen
    if _chosen is not None:
        return _chosen
    env = os.environ if environ is None else environ
    wanted = env.get(ENV, "auto").strip() or "auto"
    if sys.platform != "linux":
        _chosen = blas_in_use()
        return _chosen
    if "mlx.core" in sys.modules:
        log.warning("mlx was imported before the BLAS was chosen; it keeps the bundled one")
        _chosen = BlasInUse(_REFERENCE, optimized=False)
        return _chosen
    if wanted == "bundled":
        _chosen = BlasInUse(_REFERENCE + f"; chosen by {ENV}=bundled", optimized=False)
        return _chosen
    if wanted != "auto":
        opened = _open(wanted)
        if opened is None:
            raise ConfigurationError(
                f"cannot open {wanted!r}; name an installed BLAS library (e.g. "
                f"libopenblas.so.0) or set {ENV}=auto",
                source=ENV,
            )
        _chosen = opened
        return _chosen
    for soname in candidates:
        opened = _open(soname)
        if opened is not None:
            _chosen = opened
            return _chosen
    log.warning(
        "no optimized BLAS found; mlx runs float32 matmuls on its bundled reference BLAS, "
        "about 70x slower. Install it: apt-get install %s",
        DEBIAN_PACKAGE,
    )
    _chosen = BlasInUse(_REFERENCE, optimized=False)
    return _chosen
