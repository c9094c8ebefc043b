"""ModelProfile from config.json alone (mlxppd.core.profile.model): what each block weighs.

Exactness against the tensors mlx-lm really builds is in test_model_profile_accuracy.py; these
tests pin down the family rules (which blocks are MoE, Mamba, KV-shared), the two ends of the
pipeline, quantization pricing and the errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import AdjacencyGroup, LayerRange
from mlxppd.core.profile.model import (
    profile_from_config,
    profile_tensors,
    profiled_model_types,
    read_model_config,
)
from tests.support.checkpoint_configs import GEMMA4_E2B, LLAMA_8B_4BIT
from tests.support.profile_cases import CASES

GiB = 2**30


def test_every_family_of_the_spec_table_has_a_dedicated_profile() -> None:
    spec_table = {
        "llama",
        "mistral",
        "mixtral",
        "deepseek_v3",
        "llama4",
        "gpt_oss",
        "gemma3",
        "gemma4",
        "glm4",
        "glm4_moe",
        "glm4_moe_lite",
        "glm_moe_dsa",
        "qwen3",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
        "jamba",
        "nemotron_h",
        "kimi_k3",
    }
    assert spec_table <= set(profiled_model_types())


def test_a_dense_4bit_llama_costs_what_its_packed_tensors_cost() -> None:
    profile = profile_from_config(LLAMA_8B_4BIT)
    hidden, inter, kv = 4096, 14336, 1024

    def q4(rows: int, cols: int) -> int:
        # 4 bits per weight + one bf16 scale and one bf16 bias per 64 weights
        return rows * cols // 2 + 2 * rows * (cols // 64) * 2

    block = (
        q4(hidden, hidden) * 2  # q_proj, o_proj
        + q4(kv, hidden) * 2  # k_proj, v_proj
        + q4(inter, hidden) * 2  # gate_proj, up_proj
        + q4(hidden, inter)  # down_proj
        + 2 * hidden * 2  # two bf16 RMSNorm weights
    )
    assert profile.layer_bytes == (block,) * 32
    assert profile.embedding_bytes == q4(128256, hidden)
    assert profile.lm_head_bytes == q4(128256, hidden) + hidden * 2
    assert profile.shared_end_bytes == 0
    assert 4.0 * GiB < profile.total_bytes < 4.5 * GiB


def test_tied_embeddings_are_held_by_both_ends_but_once_by_a_single_stage() -> None:
    profile = profile_from_config({**LLAMA_8B_4BIT, "tie_word_embeddings": True})
    table = profile.embedding_bytes
    assert profile.lm_head_bytes == table + 4096 * 2  # the table again, plus the final norm
    assert profile.shared_end_bytes == table
    everything = LayerRange(0, 32)
    alone = profile.stage_bytes(everything, first=True, last=True)
    assert alone == sum(profile.layer_bytes) + table + 4096 * 2 == profile.total_bytes


def test_deepseek_v3_counts_the_blocks_mlx_lm_builds_not_the_mtp_head() -> None:
    config = {
        **CASES["deepseek_v3"][0],
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
    }
    profile = profile_from_config(config)
    assert profile.num_layers == 61
    assert profile.layer_kinds[:3] == ("mla+mlp",) * 3
    assert set(profile.layer_kinds[3:]) == {"mla+moe"}
    assert min(profile.layer_bytes[3:]) > max(profile.layer_bytes[:3])


def test_deepseek_moe_layer_freq_marks_every_nth_block() -> None:
    profile = profile_from_config({**CASES["deepseek_v3"][0], "moe_layer_freq": 2})
    # MoE where i >= first_k_dense_replace (1) and i % 2 == 0
    assert profile.layer_kinds == ("mla+mlp", "mla+mlp", "mla+moe", "mla+mlp", "mla+moe")


def test_llama4_interleaves_moe_blocks_and_prices_dense_ones_with_intermediate_size_mlp() -> None:
    profile = profile_from_config(CASES["llama4-4bit"][0])
    assert profile.layer_kinds == ("attention+mlp", "attention+moe") * 2
    tensors = profile_tensors(CASES["llama4-4bit"][0])
    dense = tensors["layer.0"]
    # intermediate_size_mlp = 128 rows of 64 inputs at 4 bits, group 32
    assert "language_model.model.layers.0.feed_forward.gate_proj.weight" in dense
    moe = tensors["layer.1"]
    assert "language_model.model.layers.1.feed_forward.experts.gate_proj.weight" in moe
    assert "language_model.model.layers.1.feed_forward.shared_expert.up_proj.weight" in moe


def test_jamba_marks_attention_and_moe_blocks_by_period_and_offset() -> None:
    profile = profile_from_config({**CASES["jamba-4bit"][0], "num_hidden_layers": 8})
    assert profile.layer_kinds == ("mamba+mlp", "attention+moe") * 4


def test_nemotron_h_reads_its_hybrid_override_pattern() -> None:
    profile = profile_from_config(CASES["nemotron_h-4bit"][0])
    assert profile.layer_kinds == ("mamba2", "attention", "mlp", "moe", "mamba2")
    listed = {**CASES["nemotron_h-4bit"][0], "hybrid_override_pattern": None}
    listed["layers_block_type"] = ["mamba", "attention", "mlp", "moe", "mamba"]
    assert profile_from_config(listed).layer_bytes == profile.layer_bytes


def test_qwen3_next_recurrent_and_attention_blocks() -> None:
    profile = profile_from_config(CASES["qwen3_next-4bit"][0])
    # full_attention_interval 2; layer 1 is in mlp_only_layers
    assert profile.layer_kinds == (
        "gated-deltanet+moe",
        "attention+mlp",
        "gated-deltanet+moe",
        "attention+moe",
    )


def test_gemma4_kv_shared_layers_form_adjacency_groups_with_their_sources() -> None:
    profile = profile_from_config(GEMMA4_E2B)
    groups = profile.adjacency_groups
    assert len(groups) == 20
    # layers 15-34 share; the last sliding source before them is 13, the last full one 14
    assert AdjacencyGroup(13, 15) in groups and AdjacencyGroup(14, 19) in groups
    assert {g.first for g in groups} == {13, 14}
    assert {g.last for g in groups} == set(range(15, 35))
    assert all("reads the KV cache of layer" in g.reason for g in groups)


def test_gemma4_consumer_blocks_carry_the_double_wide_mlp_and_no_kv_projections() -> None:
    tensors = profile_tensors(GEMMA4_E2B)
    source, consumer = tensors["layer.14"], tensors["layer.34"]
    prefix = "language_model.model.layers"
    assert f"{prefix}.14.self_attn.k_proj.weight" in source
    assert f"{prefix}.34.self_attn.k_proj.weight" not in consumer
    wide = consumer[f"{prefix}.34.mlp.gate_proj.weight"]
    assert wide == 2 * source[f"{prefix}.14.mlp.gate_proj.weight"]
    narrow = profile_from_config(
        {**GEMMA4_E2B, "text_config": {**GEMMA4_E2B["text_config"], "use_double_wide_mlp": False}}
    )
    assert narrow.layer_bytes[34] < profile_from_config(GEMMA4_E2B).layer_bytes[34]


def test_gemma4_per_layer_input_tables_are_counted_on_stage_zero() -> None:
    profile = profile_from_config(GEMMA4_E2B)
    ends = profile_tensors(GEMMA4_E2B)
    assert "language_model.model.embed_tokens_per_layer.weight" in ends["embedding"]
    assert "language_model.model.per_layer_model_projection.weight" in ends["embedding"]
    # Tied: the last stage holds the token table, never the per-layer table.
    table = sum(v for k, v in ends["embedding"].items() if ".embed_tokens." in k)
    assert profile.shared_end_bytes == table
    assert profile.embedding_bytes > profile.lm_head_bytes > table


def test_kimi_k3_is_priced_but_refused_for_pipeline_execution() -> None:
    profile = profile_from_config(CASES["kimi_k3-4bit"][0])
    assert profile.layer_kinds == ("kda+mlp", "mla+moe", "kda+moe", "mla+moe")
    assert profile.pipeline_refusal is not None
    assert "kimi_k3 has no pipeline stage executor" in profile.pipeline_refusal


def test_hugging_face_mxfp4_checkpoints_quantize_only_the_experts() -> None:
    config = {
        **CASES["gpt_oss-4bit"][0],
        "quantization_config": {"quant_method": "mxfp4"},
        "torch_dtype": "bfloat16",
    }
    layer = profile_tensors(config)["layer.0"]
    experts = "model.layers.0.mlp.experts.gate_proj"
    # 4 experts x 64 rows x 64 inputs at 4 bits, one uint8 scale per 32 inputs, no biases
    assert layer[f"{experts}.weight"] == 4 * 64 * 64 // 2
    assert layer[f"{experts}.scales"] == 4 * 64 * 2
    assert f"{experts}.biases" not in layer
    assert layer["model.layers.0.self_attn.q_proj.weight"] == 64 * 64 * 2  # bf16, untouched


def test_per_module_quantization_entries_win() -> None:
    config = {
        **LLAMA_8B_4BIT,
        "quantization": {
            "group_size": 64,
            "bits": 4,
            "model.embed_tokens": {"group_size": 32, "bits": 8},
            "lm_head": False,
        },
    }
    ends = profile_tensors(config)
    assert ends["embedding"]["model.embed_tokens.weight"] == 128256 * 4096
    assert ends["embedding"]["model.embed_tokens.scales"] == 128256 * 4096 // 32 * 2
    assert ends["head"]["lm_head.weight"] == 128256 * 4096 * 2


def test_inputs_that_do_not_split_into_groups_stay_unquantized() -> None:
    config = {**LLAMA_8B_4BIT, "intermediate_size": 14000}  # 14000 % 64 != 0
    layer = profile_tensors(config)["layer.0"]
    assert layer["model.layers.0.mlp.down_proj.weight"] == 4096 * 14000 * 2
    assert "model.layers.0.mlp.down_proj.scales" not in layer
    assert "model.layers.0.mlp.gate_proj.scales" in layer


def test_unknown_model_types_fall_back_to_llama_like_blocks_with_a_note() -> None:
    profile = profile_from_config({**LLAMA_8B_4BIT, "model_type": "olmo2"})
    assert profile.layer_bytes == profile_from_config(LLAMA_8B_4BIT).layer_bytes
    assert profile.family == "olmo2 (priced as llama-like blocks)"
    assert any("no dedicated profile" in n for n in profile.notes)


def test_a_missing_key_is_named() -> None:
    config: dict[str, Any] = {k: v for k, v in LLAMA_8B_4BIT.items() if k != "hidden_size"}
    with pytest.raises(ConfigurationError) as info:
        profile_from_config(config)
    assert str(info.value).startswith("config.json: hidden_size: missing")
    nested = {"model_type": "llama4", "text_config": {"hidden_size": 64}}
    with pytest.raises(ConfigurationError, match=r"text_config\.num_hidden_layers: missing"):
        profile_from_config(nested)


def test_a_malformed_value_is_named() -> None:
    with pytest.raises(ConfigurationError, match="num_hidden_layers: expected a whole number"):
        profile_from_config({**LLAMA_8B_4BIT, "num_hidden_layers": "32"})


def test_read_model_config_takes_a_directory_or_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B_4BIT))
    assert read_model_config(tmp_path) == read_model_config(tmp_path / "config.json")
    with pytest.raises(ConfigurationError, match="missing.json does not exist"):
        read_model_config(tmp_path / "missing.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigurationError, match="has no config.json"):
        read_model_config(empty)
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ConfigurationError, match="not valid JSON"):
        read_model_config(tmp_path / "bad.json")
