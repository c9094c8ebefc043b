"""Block layouts of the multi-head latent attention (MLA) families.

DeepSeek V3 (and Kimi K2, which mlx-lm loads as DeepSeek V3), GLM 4 MoE Lite, GLM MoE DSA (the
DeepSeek V3.2 loader with its sparse-attention indexer) and Kimi K3 (MLA blocks interleaved with
KDA linear-attention blocks). mlx-lm splits each checkpoint's ``kv_b_proj`` into two per-head
``MultiLinear`` tensors (``embed_q``, ``unembed_out``) while loading; the profile prices those.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mlxppd.core.profile.builders import moe_gate
from mlxppd.core.profile.pricing import (
    ConfigView,
    Layout,
    Part,
    Pricer,
    QuantParams,
    add_ends,
    glu_mlp,
    new_layout,
    switch_glu,
)


def _mla(part: Part, c: ConfigView, hidden: int, heads: int, *, bias: bool = False) -> None:
    q_lora = c.opt_int("q_lora_rank")
    nope, rope = c.int("qk_nope_head_dim"), c.int("qk_rope_head_dim")
    kv_lora, v_dim = c.int("kv_lora_rank"), c.int("v_head_dim")
    if q_lora is None:
        part.linear("self_attn.q_proj", hidden, heads * (nope + rope))
    else:
        part.linear("self_attn.q_a_proj", hidden, q_lora, bias=bias)
        part.norm("self_attn.q_a_layernorm", q_lora)
        part.linear("self_attn.q_b_proj", q_lora, heads * (nope + rope))
    part.linear("self_attn.kv_a_proj_with_mqa", hidden, kv_lora + rope, bias=bias)
    part.norm("self_attn.kv_a_layernorm", kv_lora)
    part.multi_linear("self_attn.embed_q", nope, kv_lora, heads)
    part.multi_linear("self_attn.unembed_out", kv_lora, v_dim, heads)
    part.linear("self_attn.o_proj", heads * v_dim, hidden, bias=bias)


def _with_defaults(config: Mapping[str, Any], defaults: Mapping[str, Any]) -> ConfigView:
    """mlx-lm's ModelArgs defaults under the config's own values.

    An explicit null stays null, as in mlx-lm (``q_lora_rank: null`` means no query LoRA).
    """
    merged = dict(defaults)
    merged.update(config)
    return ConfigView(merged)


_DEEPSEEK_V3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 102400,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "moe_intermediate_size": 1407,
    "num_hidden_layers": 30,
    "num_attention_heads": 32,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 0,
}

_GLM4_MOE_LITE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 154880,
    "hidden_size": 2048,
    "intermediate_size": 10240,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 47,
    "num_attention_heads": 20,
    "n_shared_experts": 1,
    "n_routed_experts": 64,
    "kv_lora_rank": 512,
    "q_lora_rank": 768,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
}


def _deepseek_like(c: ConfigView, pricer: Pricer, family: str, *, indexer: bool = False) -> Layout:
    """DeepSeek V3's block: MLA, then MoE where ``i >= first_k_dense_replace`` and
    ``i % moe_layer_freq == 0`` (dense MLP elsewhere). The MTP block that checkpoints carry at
    index ``num_hidden_layers`` is dropped by mlx-lm's sanitize, so it is not counted.
    """
    hidden, n, heads = (
        c.int("hidden_size"),
        c.int("num_hidden_layers"),
        c.int("num_attention_heads"),
    )
    bias = c.bool("attention_bias", False)
    experts = c.opt_int("n_routed_experts")
    n_shared = c.opt_int("n_shared_experts")
    first_dense, freq = c.int("first_k_dense_replace"), c.int("moe_layer_freq")
    layout = new_layout(pricer, family, n, "model.layers.")
    for i, part in enumerate(layout.layers):
        _mla(part, c, hidden, heads, bias=bias)
        if indexer:
            # deepseek_v32.py's Indexer (the DSA lightning indexer) sits inside self_attn.
            q_lora = c.int("q_lora_rank")
            idx_heads, idx_dim = c.int("index_n_heads"), c.int("index_head_dim")
            part.linear("self_attn.indexer.wq_b", q_lora, idx_heads * idx_dim)
            part.linear("self_attn.indexer.wk", hidden, idx_dim)
            part.layer_norm("self_attn.indexer.k_norm", idx_dim)
            part.linear("self_attn.indexer.weights_proj", hidden, idx_heads)
        if experts is not None and i >= first_dense and i % freq == 0:
            moe_inter = c.int("moe_intermediate_size")
            switch_glu(part, "mlp.switch_mlp", hidden, moe_inter, experts)
            moe_gate(part, experts, hidden)
            if n_shared is not None:
                glu_mlp(part, "mlp.shared_experts", hidden, moe_inter * n_shared)
            layout.kinds[i] = "mla+moe"
        else:
            glu_mlp(part, "mlp", hidden, c.int("intermediate_size"))
            layout.kinds[i] = "mla+mlp"
        part.norm("input_layernorm", hidden)
        part.norm("post_attention_layernorm", hidden)
    add_ends(layout, "model.", c.int("vocab_size"), hidden, tied=False)
    return layout


def deepseek_v3(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    return _deepseek_like(_with_defaults(config, _DEEPSEEK_V3_DEFAULTS), pricer, "deepseek_v3")


def glm4_moe_lite(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    return _deepseek_like(_with_defaults(config, _GLM4_MOE_LITE_DEFAULTS), pricer, "glm4")


def glm_moe_dsa(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    """glm_moe_dsa.py: DeepSeek V3.2's blocks (MLA plus an indexer); every key is required."""
    return _deepseek_like(ConfigView(config), pricer, "glm_moe_dsa", indexer=True)


def _kimi_rule(path: str) -> bool | QuantParams:
    # kimi_k3.py's quant_predicate: 8-bit routers, attention-residual projections unquantized.
    if path.endswith("mlp.gate"):
        return QuantParams(8, 64)
    return not path.endswith("res_proj")


def kimi_k3(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    """kimi_k3.py: KDA linear-attention blocks (``linear_attn_config.kda_layers``, 1-based) and
    NoPE MLA blocks; MoE from ``first_k_dense_replace`` every ``moe_layer_freq`` blocks, with an
    optional latent expert projection. Priced for planning, refused for pipeline execution.
    """
    text = config.get("text_config")
    c = ConfigView(text, "text_config.") if isinstance(text, Mapping) else ConfigView(config)
    pricer = dataclasses.replace(pricer, rule=_kimi_rule)
    hidden, n = c.int("hidden_size", 7168), c.int("num_hidden_layers", 93)
    heads = c.int("num_attention_heads", 96)
    linear_cfg = ConfigView(c.get("linear_attn_config", {}), f"{c.key_prefix}linear_attn_config.")
    kda_layers = set(linear_cfg.get("kda_layers", []))
    experts = c.opt_int("num_experts") or 0
    first_dense, freq = c.int("first_k_dense_replace", 0), c.int("moe_layer_freq", 1)
    attn_res = c.opt_int("attn_res_block_size") is not None
    layout = new_layout(pricer, "kimi_k3", n, "language_model.model.layers.")
    for i, part in enumerate(layout.layers):
        if i + 1 in kda_layers:
            kh, kd = linear_cfg.int("num_heads"), linear_cfg.int("head_dim")
            proj = kh * kd
            part.linear("self_attn.qkv_proj", hidden, 3 * proj)
            part.conv1d(
                "self_attn.qkv_conv.conv", 3 * proj, linear_cfg.int("short_conv_kernel_size")
            )
            part.linear("self_attn.f_a_proj", hidden, kd)
            part.linear("self_attn.f_b_proj", kd, proj)
            part.linear("self_attn.b_proj", hidden, kh)
            if linear_cfg.bool("use_full_rank_gate", False):
                part.linear("self_attn.g_proj", hidden, proj)
            else:
                part.linear("self_attn.g_a_proj", hidden, kd)
                part.linear("self_attn.g_b_proj", kd, proj)
            part.param("self_attn.A_log", kh, keep_dtype=True)
            part.param("self_attn.dt_bias", proj, keep_dtype=True)
            part.norm("self_attn.o_norm", kd)
            part.linear("self_attn.o_proj", proj, hidden)
            attn_kind = "kda"
        else:
            _mla(part, c, hidden, heads)
            if c.bool("mla_use_output_gate", False):
                part.linear("self_attn.g_proj", hidden, heads * c.int("v_head_dim"))
            attn_kind = "mla"
        if experts > 0 and i >= first_dense and i % freq == 0:
            moe_inter = c.int("moe_intermediate_size")
            latent = c.opt_int("routed_expert_hidden_size")
            part.linear("mlp.gate", hidden, experts)
            switch_glu(part, "mlp.switch_mlp", latent or hidden, moe_inter, experts)
            part.param("mlp.e_score_correction_bias", experts, keep_dtype=True)
            if latent is not None:
                part.linear("mlp.routed_expert_down_proj", hidden, latent)
                part.linear("mlp.routed_expert_up_proj", latent, hidden)
                if c.bool("latent_moe_use_norm", False):
                    part.norm("mlp.routed_expert_norm", latent)
            shared = c.int("num_shared_experts", 0)
            if shared:
                glu_mlp(part, "mlp.shared_experts", hidden, moe_inter * shared)
            layout.kinds[i] = f"{attn_kind}+moe"
        else:
            glu_mlp(part, "mlp", hidden, c.int("intermediate_size", 33792))
            layout.kinds[i] = f"{attn_kind}+mlp"
        part.norm("input_layernorm", hidden)
        part.norm("post_attention_layernorm", hidden)
        if attn_res:
            for name in ("self_attention_res", "mlp_res"):
                part.linear(f"{name}_proj", hidden, 1)
                part.norm(f"{name}_norm", hidden)
    tied = c.bool("tie_word_embeddings", False)
    vocab = c.int("vocab_size", 163840)
    prefix = "language_model.model."
    add_ends(layout, prefix, vocab, hidden, tied=tied, lm_head="language_model.lm_head")
    if attn_res:
        layout.head.linear(f"{prefix}output_attn_res_proj", hidden, 1)
        layout.head.norm(f"{prefix}output_attn_res_norm", hidden)
    # The same words the engine uses when it refuses a split of this family.
    layout.refusal = (
        "kimi_k3 has no pipeline stage executor: its layers cannot be split across stages; "
        "drop --pp-size/--pp-layers to run it in one process"
    )
    return layout
