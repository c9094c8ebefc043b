"""Stage processes import mlx-lm's model code without its package's front door (transformers)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlxppd.core.profile.families import FAMILIES
from mlxppd.engine.stage import model_classes

CHECK = """
import sys
from mlxppd.engine.mlx_lm_import import skip_package_init
assert skip_package_init()
import mlxppd.runtime.serve, mlxppd.runtime.agent.loop
from mlxppd.engine.stage import model_classes
model, args = model_classes({"model_type": "qwen3"})
print(model.__module__, "transformers" in sys.modules)
from mlx_lm.utils import load_tokenizer  # a coordinator's tokenizer still loads on demand
print("transformers" in sys.modules)
"""


def test_a_stage_process_never_imports_transformers_until_it_tokenizes() -> None:
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["mlx_lm.models.qwen3", "False", "True"]


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_model_classes_are_mlx_lms_own_choice(model_type: str) -> None:
    from mlx_lm.utils import _get_classes

    config = {"model_type": model_type}
    assert model_classes(config) == _get_classes(config)
