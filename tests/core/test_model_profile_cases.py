"""Every model type the profile prices has a tiny case in tests/support/profile_cases.py."""

from __future__ import annotations

from tests.support.profile_cases import CASES


def test_every_profiled_model_type_has_a_tiny_case() -> None:
    from mlxppd.core.profile.model import profiled_model_types

    covered = {config["model_type"] for config, _ in CASES.values()}
    # kimi_k2 is mlx-lm's alias of deepseek_v3, priced by the same layout
    assert set(profiled_model_types()) - {"kimi_k2"} <= covered
