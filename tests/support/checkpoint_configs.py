"""``config.json`` of real checkpoints at full size (Llama 3 8B, gemma-4-e2b), 4-bit: what
the profile, partition and plan tests price and split."""

from __future__ import annotations

from typing import Any

#: Llama 3 8B's shape, quantized to 4 bits in groups of 64
LLAMA_8B_4BIT: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization": {"group_size": 64, "bits": 4},
}

#: gemma-4-e2b, 4-bit: 35 blocks, the last 20 reading the K/V of earlier ones (KV-sharing groups)
GEMMA4_E2B: dict[str, Any] = {
    "model_type": "gemma4",
    "vocab_size": 262144,
    "text_config": {
        "model_type": "gemma4_text",
        "hidden_size": 1536,
        "num_hidden_layers": 35,
        "intermediate_size": 6144,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_kv_shared_layers": 20,
        "hidden_size_per_layer_input": 256,
        "vocab_size_per_layer_input": 262144,
        "use_double_wide_mlp": True,
        "sliding_window": 512,
        "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
        "tie_word_embeddings": True,
    },
    "quantization": {"group_size": 64, "bits": 4},
    "torch_dtype": "bfloat16",
}
