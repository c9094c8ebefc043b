"""Tiny random-weight configs, one per family (dense, MoE, MLA, sliding window...).

Each case: (config, quantize_bits or None, splits as --pp-layers strings). The recurrent families
(SSM / linear-attention blocks beside attention blocks) and Gemma 4 live in
``family_cases_boundaries.py``.
"""

from __future__ import annotations

from typing import Any

Case = tuple[dict[str, Any], int | None, tuple[str, ...]]

_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

_SPLITS = ("0-1,2-3", "0-0,1-2,3-3")
_MLA: dict[str, Any] = {
    "kv_lora_rank": 32,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "num_key_value_heads": 4,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.5,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 512,
}

CASES: dict[str, Case] = {
    "llama": ({**_BASE, "model_type": "llama"}, None, ("0-1,2-3", "0-0,1-2,3-3")),
    "mistral": (
        {**_BASE, "model_type": "mistral", "tie_word_embeddings": True},
        4,
        ("0-1,2-3", "0-1,2-2,3-3"),
    ),
    "mixtral": (
        {**_BASE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
        4,
        _SPLITS,
    ),
    "qwen3": (
        {**_BASE, "model_type": "qwen3", "head_dim": 16, "max_position_embeddings": 512},
        None,
        _SPLITS,
    ),
    "glm4": (
        {
            **_BASE,
            "model_type": "glm4",
            "attention_bias": True,
            "head_dim": 16,
            "partial_rotary_factor": 0.5,
        },
        None,
        _SPLITS,
    ),
    "glm4_moe": (
        {
            **_BASE,
            "model_type": "glm4_moe",
            "max_position_embeddings": 512,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "n_group": 1,
            "head_dim": 16,
            "topk_group": 1,
            "n_shared_experts": 1,
            "n_routed_experts": 4,
            "routed_scaling_factor": 1.5,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "rope_scaling": None,
            "use_qk_norm": True,
            "attention_bias": False,
            "partial_rotary_factor": 0.5,
        },
        8,
        _SPLITS,
    ),
    "glm4_moe_lite": ({**_BASE, **_MLA, "model_type": "glm4_moe_lite"}, None, _SPLITS),
    "deepseek_v3": ({**_BASE, **_MLA, "model_type": "deepseek_v3"}, 4, _SPLITS),
    "glm_moe_dsa": (
        {
            **_BASE,
            **_MLA,
            "model_type": "glm_moe_dsa",
            "index_head_dim": 32,
            "index_n_heads": 2,
            "index_topk": 8,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "attention_bias": False,
        },
        None,
        _SPLITS,
    ),
    "gpt_oss": (
        {
            **_BASE,
            "model_type": "gpt_oss",
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
        None,
        ("0-0,1-3", "0-1,2-2,3-3"),
    ),
    "gemma3_text": (
        {
            **_BASE,
            "model_type": "gemma3_text",
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "sliding_window_pattern": 3,
            "num_hidden_layers": 6,
        },
        None,
        ("0-2,3-5", "0-0,1-3,4-5"),
    ),
    # See tests/support/family_cases_boundaries.py for qwen3_5; this is its VLM checkpoint's text
    # path, which shares the model_type but advertises its own wire name.
    "qwen3_5_vlm": (
        {
            "model_type": "qwen3_5",
            "vision_config": {"depth": 2, "hidden_size": 32},
            "text_config": {"__from__": "qwen3_5"},
        },
        None,
        ("0-2,3-5",),
    ),
    "qwen3_5_moe_vlm": (
        {
            "model_type": "qwen3_5_moe",
            "vision_config": {"depth": 2, "hidden_size": 32},
            "text_config": {"__from__": "qwen3_5_moe"},
        },
        8,
        ("0-1,2-5",),
    ),
    "llama4": (
        {
            "model_type": "llama4",
            "text_config": {
                **_BASE,
                "model_type": "llama4_text",
                "attention_bias": False,
                "attention_chunk_size": 8,
                "head_dim": 16,
                "interleave_moe_layer_step": 2,
                "intermediate_size_mlp": 128,
                "max_position_embeddings": 512,
                "num_experts_per_tok": 1,
                "num_local_experts": 4,
                "rope_scaling": None,
                "use_qk_norm": True,
            },
        },
        None,
        ("0-1,2-3", "0-2,3-3", "0-0,1-2,3-3"),
    ),
}

#: Kimi K3 (KDA linear attention beside MLA): not in ``CASES``, it runs in one process only
KIMI_K3: dict[str, Any] = {
    "model_type": "kimi_k3",
    "text_config": {
        "model_type": "kimi_linear",
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        # Layers 1 and 3 (1-based) are linear "KDA" attention; the others MLA.
        "linear_attn_config": {
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 3],
        },
        "q_lora_rank": 64,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
    },
}


def resolve_text_configs(cases: dict[str, Case], others: dict[str, Case]) -> None:
    """Fill ``{"__from__": name}`` text configs from another case (written once, used twice)."""
    for name, (config, bits, splits) in list(cases.items()):
        source = config.get("text_config", {}).get("__from__")
        if source:
            text = dict(others[source][0].get("text_config") or others[source][0])
            cases[name] = ({**config, "text_config": text}, bits, splits)
