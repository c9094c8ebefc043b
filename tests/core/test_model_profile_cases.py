"""Tiny configs of every profiled family, and how to measure what mlx-lm actually builds.

Shared by the profile accuracy tests and the plan CLI tests. Dimensions are small but keep the
shapes that matter: some input dims divide by the quantization group size and some do not, so
both of mlx-lm's paths (quantized, left in the float dtype) are exercised.
"""

from __future__ import annotations

import re
from typing import Any

F32 = {"torch_dtype": "float32"}

_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "tie_word_embeddings": False,
    **F32,
}

_DEEPSEEK: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "qk_nope_head_dim": 32,
    "n_group": 2,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "moe_layer_freq": 2,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 512,
    **F32,
}

_GEMMA4_TEXT: dict[str, Any] = {
    "model_type": "gemma4_text",
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_key_value_heads": 1,
    "vocab_size": 256,
    "vocab_size_per_layer_input": 128,
    "num_kv_shared_layers": 3,
    "hidden_size_per_layer_input": 16,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
    * 2,
    "use_double_wide_mlp": True,
    **F32,
}

_QWEN35_TEXT: dict[str, Any] = {
    "model_type": "qwen3_5",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "head_dim": 16,
    "full_attention_interval": 2,
    "tie_word_embeddings": True,
    **F32,
}

#: name -> (config, quantization bits or None); built with mlx-lm's own model class
CASES: dict[str, tuple[dict[str, Any], int | None]] = {
    "llama": (_LLAMA, None),
    "llama-tied-4bit": ({**_LLAMA, "tie_word_embeddings": True}, 4),
    "mistral-8bit": ({**_LLAMA, "model_type": "mistral", "head_dim": 32}, 8),
    "mixtral-4bit": (
        {
            "model_type": "mixtral",
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            **F32,
        },
        4,
    ),
    "deepseek_v3": (_DEEPSEEK, None),
    "deepseek_v3-4bit": (_DEEPSEEK, 4),
    "deepseek_v3-no-q-lora-8bit": ({**_DEEPSEEK, "q_lora_rank": None, "n_group": 1}, 8),
    "llama4-4bit": (
        {
            "model_type": "llama4",
            "text_config": {
                "model_type": "llama4_text",
                "attention_bias": False,
                "attention_chunk_size": 64,
                "head_dim": 16,
                "hidden_size": 64,
                "interleave_moe_layer_step": 2,
                "intermediate_size": 64,
                "intermediate_size_mlp": 128,
                "max_position_embeddings": 512,
                "num_attention_heads": 4,
                "num_experts_per_tok": 1,
                "num_hidden_layers": 4,
                "num_key_value_heads": 2,
                "num_local_experts": 4,
                "rms_norm_eps": 1e-5,
                "rope_scaling": None,
                "rope_theta": 10000.0,
                "use_qk_norm": True,
                "vocab_size": 256,
            },
            **F32,
        },
        4,
    ),
    "llama4_text": (
        {
            "model_type": "llama4_text",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 3,
            "vocab_size": 256,
            "intermediate_size": 64,
            "intermediate_size_mlp": 96,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "head_dim": 16,
            "tie_word_embeddings": False,
            "no_rope_layers": [1, 1, 0],
            "use_qk_norm": False,
            **F32,
        },
        None,
    ),
    "gpt_oss-4bit": (
        {
            "model_type": "gpt_oss",
            "num_hidden_layers": 4,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 64,
            "head_dim": 16,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            **F32,
        },
        4,
    ),
    "gemma3_text-4bit": (
        {
            "model_type": "gemma3_text",
            "hidden_size": 64,
            "num_hidden_layers": 6,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "head_dim": 16,
            "num_key_value_heads": 2,
            "vocab_size": 256,
            "sliding_window": 8,
            "sliding_window_pattern": 3,
            **F32,
        },
        4,
    ),
    "gemma3": (
        {
            "model_type": "gemma3",
            "vocab_size": 256,
            "text_config": {
                "model_type": "gemma3_text",
                "hidden_size": 64,
                "num_hidden_layers": 3,
                "intermediate_size": 96,
                "head_dim": 16,
                "sliding_window": 8,
                "sliding_window_pattern": 3,
            },
            **F32,
        },
        None,
    ),
    "gemma4_text": (_GEMMA4_TEXT, None),
    "gemma4_text-moe-k-eq-v-4bit": (
        {
            **_GEMMA4_TEXT,
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 2,
        },
        4,
    ),
    "gemma4-8bit": (
        {
            "model_type": "gemma4",
            "vocab_size": 256,
            "text_config": {k: v for k, v in _GEMMA4_TEXT.items() if k != "vocab_size"},
            **F32,
        },
        8,
    ),
    "glm4": (
        {
            "model_type": "glm4",
            "hidden_size": 64,
            "num_hidden_layers": 3,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "attention_bias": True,
            "head_dim": 16,
            "rms_norm_eps": 1e-5,
            "vocab_size": 256,
            "num_key_value_heads": 2,
            "partial_rotary_factor": 0.5,
            "rope_theta": 10000.0,
            **F32,
        },
        4,
    ),
    "glm4_moe-4bit": (
        {
            "model_type": "glm4_moe",
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "max_position_embeddings": 512,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "num_attention_heads": 4,
            "n_group": 1,
            "head_dim": 16,
            "topk_group": 1,
            "n_shared_experts": 1,
            "n_routed_experts": 4,
            "routed_scaling_factor": 1.0,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "rope_scaling": None,
            "use_qk_norm": True,
            "tie_word_embeddings": False,
            "attention_bias": True,
            "partial_rotary_factor": 0.5,
            **F32,
        },
        4,
    ),
    "glm4_moe_lite-4bit": (
        {
            "model_type": "glm4_moe_lite",
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_shared_experts": 1,
            "n_routed_experts": 4,
            "kv_lora_rank": 32,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            **F32,
        },
        4,
    ),
    "glm_moe_dsa-4bit": (
        {
            "model_type": "glm_moe_dsa",
            "vocab_size": 256,
            "hidden_size": 64,
            "index_head_dim": 32,
            "index_n_heads": 2,
            "index_topk": 8,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_shared_experts": 1,
            "n_routed_experts": 4,
            "routed_scaling_factor": 1.0,
            "kv_lora_rank": 32,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "qk_nope_head_dim": 32,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            "n_group": 1,
            "topk_group": 1,
            "num_experts_per_tok": 2,
            "moe_layer_freq": 1,
            "first_k_dense_replace": 1,
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "attention_bias": False,
            **F32,
        },
        4,
    ),
    "qwen3-4bit": (
        {
            **_LLAMA,
            "model_type": "qwen3",
            "head_dim": 16,
            "rope_theta": 10000.0,
            "max_position_embeddings": 512,
            "tie_word_embeddings": True,
        },
        4,
    ),
    "qwen3_5": (_QWEN35_TEXT, None),
    "qwen3_5_moe-4bit": (
        {
            "model_type": "qwen3_5_moe",
            "text_config": {
                **_QWEN35_TEXT,
                "model_type": "qwen3_5_moe_text",
                "tie_word_embeddings": False,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "shared_expert_intermediate_size": 64,
                "moe_intermediate_size": 32,
            },
            **F32,
        },
        4,
    ),
    "qwen3_next-4bit": (
        {
            "model_type": "qwen3_next",
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "intermediate_size": 128,
            "num_attention_heads": 4,
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
            "num_key_value_heads": 2,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "max_position_embeddings": 512,
            "head_dim": 16,
            "full_attention_interval": 2,
            **F32,
        },
        4,
    ),
    "jamba-4bit": (
        {
            "model_type": "jamba",
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "attn_layer_offset": 1,
            "attn_layer_period": 2,
            "expert_layer_offset": 1,
            "expert_layer_period": 2,
            "mamba_d_conv": 4,
            "mamba_d_state": 16,
            "mamba_expand": 2,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 512,
            "vocab_size": 256,
            **F32,
        },
        4,
    ),
    "nemotron_h-4bit": (
        {
            "model_type": "nemotron_h",
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 96,
            "max_position_embeddings": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "attention_bias": False,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "mamba_proj_bias": False,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "n_groups": 2,
            "mlp_bias": False,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "hybrid_override_pattern": "M*-EM",
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 64,
            "n_group": 1,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "topk_group": 1,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
            **F32,
        },
        4,
    ),
    "kimi_k3-4bit": (
        {
            "model_type": "kimi_k3",
            "text_config": {
                "model_type": "kimi_linear",
                "vocab_size": 256,
                "hidden_size": 64,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "intermediate_size": 128,
                "linear_attn_config": {
                    "kda_layers": [1, 3],
                    "num_heads": 2,
                    "head_dim": 16,
                    "short_conv_kernel_size": 4,
                },
                "attn_res_block_size": 2,
                "q_lora_rank": 32,
                "kv_lora_rank": 32,
                "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 16,
                "v_head_dim": 16,
                "mla_use_output_gate": True,
                "num_experts": 4,
                "num_experts_per_token": 2,
                "num_shared_experts": 1,
                "moe_intermediate_size": 32,
                "first_k_dense_replace": 1,
                "routed_expert_hidden_size": 32,
                "latent_moe_use_norm": True,
            },
            **F32,
        },
        4,
    ),
}

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def built_tensors(
    config: dict[str, Any], bits: int | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """mlx-lm's model for ``config`` (quantized as ``mlx_lm convert`` would): (tensors, config).

    Returns the parameter name -> array map of the loaded model and the config the converter
    writes (with its per-path quantization entries). Gemma 3 builds an ``lm_head`` that mlx-lm's
    loader drops when the checkpoint has none (tied), so it is dropped here the same way.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, quantize_model

    mx.random.seed(0)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if bits is not None:
        model, config = quantize_model(model, config, group_size=32, bits=bits)
    tensors = dict(tree_flatten(model.parameters()))
    if config["model_type"] in ("gemma3", "gemma3_text"):
        text = config.get("text_config", config)
        if text.get("tie_word_embeddings", config.get("tie_word_embeddings", True)):
            tensors = {k: v for k, v in tensors.items() if "lm_head." not in k}
    return tensors, config


def layer_of(name: str) -> int | None:
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def test_every_profiled_model_type_has_a_tiny_case() -> None:
    from mlxppd.core.profile.model import profiled_model_types

    covered = {config["model_type"] for config, _ in CASES.values()}
    # kimi_k2 is mlx-lm's alias of deepseek_v3, priced by the same layout
    assert set(profiled_model_types()) - {"kimi_k2"} <= covered
