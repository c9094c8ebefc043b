"""Importing mlx-lm's model code without its package's front door.

``import mlx_lm.models.llama`` first runs ``mlx_lm/__init__.py``, which imports mlx-lm's
converter, generator and tokenizer utilities, and with them ``transformers``: about 0.9 s of
CPU per process. A stage process runs models and never tokenizes (its grammar tokenizer loads
on demand), so it registers the package without running that file; every submodule imports
as usual, the tokenizer's too when a process needs one. Safe wherever nothing takes names
from the package itself (``from mlx_lm import generate``): mlxppd never does. Called first
thing by the ``mlxppd`` command (``mlxppd/cli/mlxppd_main.py``): 0.9 s less CPU per stage
process, 0.3 s per coordinator.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

__all__ = ["skip_package_init"]


def skip_package_init() -> bool:
    """Register ``mlx_lm`` without running its ``__init__`` (False: it is imported already)."""
    if "mlx_lm" in sys.modules:
        return False
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.submodule_search_locations is None:
        return False
    # What the package's __init__ sets before it imports transformers.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    package = types.ModuleType("mlx_lm")
    package.__spec__ = spec
    package.__path__ = list(spec.submodule_search_locations)
    package.__file__ = spec.origin
    sys.modules["mlx_lm"] = package
    return True
