"""Partial loading: a stage holds only its own tensors, measured in a fresh process each."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx

from mlxppd.core.layer_ranges import even_split
from mlxppd.core.stages import stage_specs

_MEASURE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import mlx.core as mx
    model_dir, which = Path(sys.argv[1]), json.loads(sys.argv[2])
    if which is None:
        from mlx_lm import load
        model = load(str(model_dir))  # kept alive while memory is read
        nbytes = None
    else:
        from mlxppd.core.stages import StageSpec
        from mlxppd.engine.stage import load_stage
        stage = load_stage(model_dir, StageSpec(*which))  # kept alive while memory is read
        nbytes = stage.parameter_bytes
    print(json.dumps({"params": nbytes, "active": mx.get_active_memory(),
                      "peak": mx.get_peak_memory()}))
    """
)


def _measure(model_dir: Path, which: list[int] | None) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(model_dir), json.dumps(which)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _checkpoint_bytes(model_dir: Path) -> dict[str, int]:
    tensors = mx.load(str(model_dir / "model.safetensors"))
    assert isinstance(tensors, dict)
    return {name: t.nbytes for name, t in tensors.items()}  # shapes only: nothing is read


def test_two_stage_split_each_stage_holds_only_its_own_tensors(embedded_model_dir: Path) -> None:
    sizes = _checkpoint_bytes(embedded_model_dir)
    whole = _measure(embedded_model_dir, None)["active"]
    # A few bytes of mlx bookkeeping (a scalar or two) sit beside the weights.
    slack = 4096
    assert sum(sizes.values()) <= whole <= sum(sizes.values()) + slack
    embedding = sum(v for k, v in sizes.items() if k.startswith("model.embed_tokens."))

    for spec in stage_specs(even_split(30, 2)):
        got = _measure(embedded_model_dir, [spec.index, spec.num_stages, spec.start, spec.end])
        owned = embedding + sum(
            v
            for k, v in sizes.items()
            if k.startswith("model.layers.") and spec.owns_layer(int(k.split(".")[2]))
        )
        if spec.has_lm_head:
            owned += sizes["model.norm.weight"]
        assert got["params"] == owned
        # Resident and peak memory: the stage never held another stage's tensors.
        assert owned <= got["active"] <= owned + slack
        assert got["peak"] <= owned + slack
        share = got["peak"] / whole
        print(f"stage {spec.index}: {got['peak']} of {whole} bytes = {share:.1%}")
        # The floor for 2 stages is (embedding + half the blocks) / whole = 66.2% here, since
        # the tied 8-bit embedding (32% of the model) must live on both ends.
        floor = (embedding + (whole - embedding) / 2) / whole
        assert share <= floor + 0.005
