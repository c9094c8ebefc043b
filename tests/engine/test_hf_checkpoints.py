"""Raw Hugging Face layouts: sanitize runs once over the whole map, so every stage agrees.

A DeepSeek V3 checkpoint stores one tensor per expert and a fused ``kv_b_proj``; mlx-lm's
``sanitize`` stacks the experts and splits ``kv_b_proj`` into ``embed_q``/``unembed_out``.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from mlxppd.core.layer_ranges import parse_pp_layers
from mlxppd.core.stages import stage_specs
from mlxppd.engine.pipeline import InProcessPipeline
from mlxppd.engine.stage import load_stage
from tests.conftest import write_tiny_model
from tests.support.family_cases import CASES


def _to_hf_layout(weights: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    nope = config["qk_nope_head_dim"]
    for name, value in weights.items():
        if ".mlp.switch_mlp." in name:
            prefix, rest = name.split(".mlp.switch_mlp.")
            for e in range(value.shape[0]):
                out[f"{prefix}.mlp.experts.{e}.{rest}"] = value[e]
        elif name.endswith("self_attn.embed_q.weight"):
            prefix = name[: -len("embed_q.weight")]
            wk = value  # (heads, kv_lora_rank, nope)
            wv = weights[f"{prefix}unembed_out.weight"]  # (heads, v_head, kv_lora_rank)
            fused = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)
            assert fused.shape[1] == nope + config["v_head_dim"]
            out[f"{prefix}kv_b_proj.weight"] = fused.reshape(-1, fused.shape[-1])
        elif name.endswith("self_attn.unembed_out.weight"):
            continue
        else:
            out[name] = value
    return out


def test_deepseek_v3_hf_layout_splits_match_mlx_lm(tmp_path: Path) -> None:
    config = CASES["deepseek_v3"][0]
    mlx_dir = write_tiny_model(tmp_path / "mlx", config)
    weights = mx.load(str(mlx_dir / "model.safetensors"))
    assert isinstance(weights, dict)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    hf = _to_hf_layout(weights, config)
    assert any(".mlp.experts.3." in k for k in hf) and any("kv_b_proj" in k for k in hf)
    mx.save_safetensors(str(hf_dir / "model.safetensors"), hf)
    (hf_dir / "config.json").write_text(json.dumps(config))

    prompt = [(13 * i + 7) % 250 for i in range(30)]
    model, _ = load_model(hf_dir)
    reference = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=20)]
    assert len(set(reference)) > 3
    for split in ("0-1,2-3", "0-0,1-2,3-3"):
        stages = [load_stage(hf_dir, s) for s in stage_specs(parse_pp_layers(split, 4))]
        tokens = [s.token for s in InProcessPipeline(stages).generate(prompt, 20)]
        assert tokens == reference, split
        # the stacked expert tensors exist only on the stage owning that layer
        for stage in stages:
            names = [n for n, _ in tree_flatten(stage.net.model.parameters())]
            stacked = [n for n in names if ".switch_mlp." in n]
            assert all(stage.spec.owns_layer(int(n.split(".")[2])) for n in stacked)
