"""Tiny configs for the families whose stage boundaries are the point (same format as
family_cases): the recurrent families (SSM / linear-attention blocks beside attention blocks)
and Gemma 4 (KV-sharing groups).

Each split is chosen to land on the interesting boundaries: attention <-> SSM for the recurrent
families (noted per case), and just outside a KV-sharing group for Gemma 4.
"""

from __future__ import annotations

from typing import Any

from tests.support.family_cases import Case

_S, _F = "sliding_attention", "full_attention"

_GEMMA4_TEXT: dict[str, Any] = {
    "model_type": "gemma4_text",
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_key_value_heads": 2,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    # blocks 6, 7 reuse the K/V of 5 (sliding) and 4 (full): no boundary may fall in 5..7.
    "num_kv_shared_layers": 2,
    "layer_types": [_S, _F, _S, _S, _F, _S, _S, _F],
    "hidden_size_per_layer_input": 16,
    "vocab_size": 256,
    "vocab_size_per_layer_input": 256,
    "sliding_window": 8,
    "enable_moe_block": True,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
    "final_logit_softcapping": 30.0,
    # Tied, the scaled-up input embedding dominates the residual and greedy decoding repeats
    # the prompt's last token forever; an own lm_head gives a varied continuation.
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
}

# The VLM config nests the text tower; layer kinds come from sliding_window_pattern here
# (s s s f s s s f), so blocks 6, 7 share the K/V of 5 and 3.
_GEMMA4_VLM: dict[str, Any] = {
    "model_type": "gemma4",
    "vocab_size": 256,
    "text_config": {
        **{k: v for k, v in _GEMMA4_TEXT.items() if k not in ("layer_types", "model_type")},
        "model_type": "gemma4_text",
        "sliding_window_pattern": 4,
        "hidden_size_per_layer_input": 32,
        "attention_k_eq_v": False,
        "enable_moe_block": False,
    },
}

# layers_block_type: m a m m a m (attention every 3rd from 1); MoE on odd layers.
_JAMBA: dict[str, Any] = {
    "model_type": "jamba",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "attn_layer_offset": 1,
    "attn_layer_period": 3,
    "expert_layer_offset": 1,
    "expert_layer_period": 2,
    "mamba_d_conv": 4,
    "mamba_d_state": 16,
    "mamba_expand": 2,
    "mamba_dt_rank": 32,  # "auto" gives 4, too narrow for 32-wide quantization groups
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "vocab_size": 256,
    "tie_word_embeddings": False,
}

# Block pattern M * E M - * M E: Mamba2, attention, MoE, MLP; num_hidden_layers comes from it.
_NEMOTRON_H: dict[str, Any] = {
    "model_type": "nemotron_h",
    "hybrid_override_pattern": ["M", "*", "E", "M", "-", "*", "M", "E"],
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "attention_bias": False,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "mamba_proj_bias": False,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "n_groups": 2,
    "mlp_bias": False,
    "layer_norm_epsilon": 1e-5,
    "use_bias": False,
    "use_conv_bias": True,
    "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64,
    "n_group": 1,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
}

# Blocks: linear linear attention, twice (full_attention_interval 3); MoE except block 1.
_QWEN3_NEXT: dict[str, Any] = {
    "model_type": "qwen3_next",
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 64,
    "mlp_only_layers": [1],
    "moe_intermediate_size": 32,
    "rms_norm_eps": 1e-6,
    "vocab_size": 256,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "max_position_embeddings": 4096,
    "full_attention_interval": 3,
    "tie_word_embeddings": False,
}

_QWEN3_5_TEXT: dict[str, Any] = {
    key: value
    for key, value in _QWEN3_NEXT.items()
    if key not in ("mlp_only_layers", "rope_theta", "partial_rotary_factor")
}

CASES: dict[str, Case] = {
    "gemma4_text": (_GEMMA4_TEXT, None, ("0-2,3-7", "0-1,2-3,4-7")),
    "gemma4": (_GEMMA4_VLM, 8, ("0-1,2-7", "0-0,1-2,3-7")),
    # attention|Mamba at 1/2; Mamba|attention at 0/1 and 3/4.
    "jamba": (_JAMBA, 4, ("0-1,2-5", "0-0,1-3,4-5")),
    # M|* at 0/1; E|M at 2/3, -|* at 4/5.
    "nemotron_h": (_NEMOTRON_H, 8, ("0-0,1-7", "0-2,3-4,5-7")),
    # attention|linear at 2/3; linear|attention at 1/2, linear|linear at 3/4.
    "qwen3_next": (_QWEN3_NEXT, 4, ("0-2,3-5", "0-1,2-3,4-5")),
    # Flat text config, dense MLPs, tied embeddings.
    "qwen3_5": (
        {
            **_QWEN3_5_TEXT,
            "model_type": "qwen3_5",
            "num_experts": 0,
            "tie_word_embeddings": True,
        },
        None,
        ("0-2,3-5", "0-1,2-3,4-5"),
    ),
    # The VLM text path: the text tower nested under text_config, MoE MLPs.
    "qwen3_5_moe": (
        {
            "model_type": "qwen3_5_moe",
            "text_config": {**_QWEN3_5_TEXT, "model_type": "qwen3_5_moe_text"},
        },
        8,
        ("0-2,3-5", "0-1,2-3,4-5"),
    ),
}
