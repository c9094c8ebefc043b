"""Block layouts of the recurrent families: SSM or linear-attention blocks beside attention blocks.

Qwen 3.5 and Qwen3-Next (gated delta-net blocks, every ``full_attention_interval``-th block
full attention), Jamba (Mamba mixers, ``attn_layer_period`` / ``attn_layer_offset`` attention,
``expert_layer_period`` / ``expert_layer_offset`` MoE) and Nemotron-H (one mixer per block from
``hybrid_override_pattern``: M Mamba2, * attention, - MLP, E MoE). A recurrent block's state is
stage-local; its weights are priced like any other block's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.profile.builders import moe_gate
from mlxppd.core.profile.pricing import (
    ConfigView,
    Layout,
    Part,
    Pricer,
    add_ends,
    attention,
    glu_mlp,
    new_layout,
    router_8bit,
    switch_glu,
)


def _qwen_moe_block(part: Part, c: ConfigView, hidden: int) -> None:
    """Qwen3NextSparseMoeBlock: router, experts, a gated shared expert."""
    experts = c.int("num_experts")
    part.linear("mlp.gate", hidden, experts)
    switch_glu(part, "mlp.switch_mlp", hidden, c.int("moe_intermediate_size"), experts)
    glu_mlp(part, "mlp.shared_expert", hidden, c.int("shared_expert_intermediate_size"))
    part.linear("mlp.shared_expert_gate", hidden, 1)


def _qwen_attention(part: Part, c: ConfigView, hidden: int) -> None:
    """Qwen3NextAttention: the query projection is twice as wide (it carries an output gate)."""
    heads = c.int("num_attention_heads")
    head_dim = c.int("head_dim", hidden // heads)
    bias = c.bool("attention_bias", False)
    attention(
        part,
        hidden,
        heads,
        c.int("num_key_value_heads"),
        head_dim,
        bias=bias,
        qk_norm=True,
        q_factor=2,
    )


def _gdn_dims(c: ConfigView) -> tuple[int, int, int, int]:
    kh, vh = c.int("linear_num_key_heads"), c.int("linear_num_value_heads")
    key_dim = kh * c.int("linear_key_head_dim")
    value_dim = vh * c.int("linear_value_head_dim")
    return key_dim, value_dim, vh, c.int("linear_value_head_dim")


def qwen3_5(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    """qwen3_5.py / qwen3_5_moe.py: always wrapped as ``language_model`` (flat configs too).

    Linear blocks hold a GatedDeltaNet with separate qkv / z / b / a input projections; every
    block is MoE when ``num_experts`` > 0.
    """
    text = config.get("text_config")
    c = ConfigView(text, "text_config.") if isinstance(text, Mapping) else ConfigView(config)
    hidden, n = c.int("hidden_size", 4096), c.int("num_hidden_layers", 32)
    experts = c.int("num_experts", 0)
    if experts > 0:
        pricer = dataclasses.replace(pricer, rule=router_8bit("mlp.gate", "shared_expert_gate"))
    interval = c.int("full_attention_interval", 4)
    key_dim, value_dim, v_heads, v_head_dim = _gdn_dims(c)
    layout = new_layout(pricer, "qwen3_5", n, "language_model.model.layers.")
    for i, part in enumerate(layout.layers):
        if (i + 1) % interval != 0:
            conv_dim = 2 * key_dim + value_dim
            part.conv1d("linear_attn.conv1d", conv_dim, c.int("linear_conv_kernel_dim", 4))
            part.linear("linear_attn.in_proj_qkv", hidden, conv_dim)
            part.linear("linear_attn.in_proj_z", hidden, value_dim)
            part.linear("linear_attn.in_proj_b", hidden, v_heads)
            part.linear("linear_attn.in_proj_a", hidden, v_heads)
            part.param("linear_attn.dt_bias", v_heads)
            # qwen3_5.py keeps A_log out of dtype casts.
            part.param("linear_attn.A_log", v_heads, keep_dtype=True)
            part.norm("linear_attn.norm", v_head_dim)
            part.linear("linear_attn.out_proj", value_dim, hidden)
            mixer = "gated-deltanet"
        else:
            _qwen_attention(part, c, hidden)
            mixer = "attention"
        part.norm("input_layernorm", hidden)
        part.norm("post_attention_layernorm", hidden)
        if experts > 0:
            _qwen_moe_block(part, c, hidden)
            layout.kinds[i] = f"{mixer}+moe"
        else:
            glu_mlp(part, "mlp", hidden, c.int("intermediate_size", 14336))
            layout.kinds[i] = f"{mixer}+mlp"
    tied = c.bool("tie_word_embeddings", False)
    vocab = c.int("vocab_size", 151936)
    prefix = "language_model.model."
    add_ends(layout, prefix, vocab, hidden, tied=tied, lm_head="language_model.lm_head")
    return layout


def qwen3_next(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    """qwen3_next.py: fused qkvz / ba projections; MoE on every ``decoder_sparse_step``-th
    block outside ``mlp_only_layers``."""
    c = ConfigView(config)
    pricer = dataclasses.replace(pricer, rule=router_8bit("mlp.gate", "shared_expert_gate"))
    hidden, n = c.int("hidden_size"), c.int("num_hidden_layers")
    experts, step = c.int("num_experts"), c.int("decoder_sparse_step")
    mlp_only = set(c.get("mlp_only_layers", []))
    interval = c.int("full_attention_interval", 4)
    key_dim, value_dim, v_heads, v_head_dim = _gdn_dims(c)
    layout = new_layout(pricer, "qwen3_next", n, "model.layers.")
    for i, part in enumerate(layout.layers):
        if (i + 1) % interval != 0:
            conv_dim = 2 * key_dim + value_dim
            part.conv1d("linear_attn.conv1d", conv_dim, c.int("linear_conv_kernel_dim"))
            part.linear("linear_attn.in_proj_qkvz", hidden, 2 * key_dim + 2 * value_dim)
            part.linear("linear_attn.in_proj_ba", hidden, 2 * v_heads)
            part.param("linear_attn.dt_bias", v_heads)
            part.param("linear_attn.A_log", v_heads)
            part.norm("linear_attn.norm", v_head_dim)
            part.linear("linear_attn.out_proj", value_dim, hidden)
            mixer = "gated-deltanet"
        else:
            _qwen_attention(part, c, hidden)
            mixer = "attention"
        part.norm("input_layernorm", hidden)
        part.norm("post_attention_layernorm", hidden)
        if i not in mlp_only and experts > 0 and (i + 1) % step == 0:
            _qwen_moe_block(part, c, hidden)
            layout.kinds[i] = f"{mixer}+moe"
        else:
            glu_mlp(part, "mlp", hidden, c.int("intermediate_size"))
            layout.kinds[i] = f"{mixer}+mlp"
    tied = c.bool("tie_word_embeddings", False)
    add_ends(layout, "model.", c.int("vocab_size"), hidden, tied=tied)
    return layout


def jamba(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    """jamba.py: Mamba mixers or attention per ``layers_block_type``; MoE feed-forward where
    ``(i + expert_layer_offset) % expert_layer_period == 0`` (mlx-lm's condition)."""
    c = ConfigView(config)
    pricer = dataclasses.replace(pricer, rule=router_8bit("router"))
    hidden = c.int("hidden_size")
    block_types: Sequence[str] | None = c.get("layers_block_type")
    if block_types is None:
        period, offset = c.int("attn_layer_period"), c.int("attn_layer_offset")
        block_types = [
            "attention" if i % period == offset else "mamba"
            for i in range(c.int("num_hidden_layers"))
        ]
    heads, kv = c.int("num_attention_heads"), c.int("num_key_value_heads")
    inter, experts = c.int("intermediate_size"), c.int("num_experts")
    e_period, e_offset = c.int("expert_layer_period"), c.int("expert_layer_offset")
    d_state, d_conv = c.int("mamba_d_state"), c.int("mamba_d_conv")
    m_inter = c.int("mamba_expand") * hidden
    dt_rank_value = c.get("mamba_dt_rank", "auto")
    dt_rank = math.ceil(hidden / 16) if dt_rank_value == "auto" else int(dt_rank_value)
    proj_bias, conv_bias = c.bool("mamba_proj_bias", False), c.bool("mamba_conv_bias", True)
    layout = new_layout(pricer, "jamba", len(block_types), "model.layers.")
    for i, part in enumerate(layout.layers):
        if block_types[i] == "attention":
            attention(part, hidden, heads, kv, hidden // heads)
            mixer = "attention"
        else:
            part.linear("mamba.in_proj", hidden, 2 * m_inter, bias=proj_bias)
            part.conv1d("mamba.conv1d", m_inter, d_conv, bias=conv_bias)
            part.linear("mamba.x_proj", m_inter, dt_rank + 2 * d_state)
            part.linear("mamba.dt_proj", dt_rank, m_inter, bias=True)
            part.param("mamba.A_log", m_inter, d_state)
            part.param("mamba.D", m_inter)
            part.linear("mamba.out_proj", m_inter, hidden, bias=proj_bias)
            part.norm("mamba.dt_layernorm", dt_rank)
            part.norm("mamba.b_layernorm", d_state)
            part.norm("mamba.c_layernorm", d_state)
            mixer = "mamba"
        if experts > 1 and (i + e_offset) % e_period == 0:
            part.linear("feed_forward.router", hidden, experts)
            switch_glu(part, "feed_forward.switch_mlp", hidden, inter, experts)
            layout.kinds[i] = f"{mixer}+moe"
        else:
            glu_mlp(part, "feed_forward", hidden, inter)
            layout.kinds[i] = f"{mixer}+mlp"
        part.norm("input_layernorm", hidden)
        part.norm("pre_ff_layernorm", hidden)
    tied = c.bool("tie_word_embeddings", True)
    add_ends(layout, "model.", c.int("vocab_size"), hidden, tied=tied, norm="final_layernorm")
    return layout


_NEMOTRON_BLOCKS = {
    "full_attention": "*",
    "linear_attention": "M",
    "moe": "E",
    "mlp": "-",
    "attention": "*",
    "mamba": "M",
    "conv": "M",
}
_NEMOTRON_KINDS = {"M": "mamba2", "*": "attention", "-": "mlp", "E": "moe"}


def _nemotron_pattern(c: ConfigView) -> str:
    pattern = c.get("hybrid_override_pattern")
    if pattern is None:
        block_types = c.get("layers_block_type") or c.get("layer_types")
        if block_types is None:
            raise ConfigurationError(
                "missing; Nemotron-H needs hybrid_override_pattern or layers_block_type "
                "to describe its blocks",
                source="config.json",
                key="hybrid_override_pattern",
            )
        unknown = sorted(set(block_types) - set(_NEMOTRON_BLOCKS))
        if unknown:
            raise ConfigurationError(
                f"unknown block types {unknown}", source="config.json", key="layers_block_type"
            )
        pattern = [_NEMOTRON_BLOCKS[t] for t in block_types]
    text = "".join(pattern)
    if set(text) - set(_NEMOTRON_KINDS):
        raise ConfigurationError(
            f"{text!r} has characters other than M, *, - and E",
            source="config.json",
            key="hybrid_override_pattern",
        )
    return text


def nemotron_h(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    """nemotron_h.py: one norm and one mixer per block, the mixer chosen by the pattern."""
    c = ConfigView(config)
    pattern = _nemotron_pattern(c)
    hidden = c.int("hidden_size")
    heads = c.int("num_attention_heads")
    head_dim = c.int("head_dim", hidden // heads)
    mlp_bias = c.bool("mlp_bias", False)
    layout = new_layout(pricer, "nemotron_h", len(pattern), "backbone.layers.")
    for i, part in enumerate(layout.layers):
        block = pattern[i]
        part.norm("norm", hidden)
        if block == "M":
            m_heads, m_dim = c.int("mamba_num_heads"), c.int("mamba_head_dim")
            m_inter = m_heads * m_dim
            conv_dim = m_inter + 2 * c.int("n_groups") * c.int("ssm_state_size")
            proj_bias = c.bool("mamba_proj_bias", False)
            part.conv1d(
                "mixer.conv1d", conv_dim, c.int("conv_kernel"), bias=c.bool("use_conv_bias", True)
            )
            part.linear("mixer.in_proj", hidden, m_inter + conv_dim + m_heads, bias=proj_bias)
            part.param("mixer.dt_bias", m_heads)
            # nemotron_h.py keeps A_log out of dtype casts.
            part.param("mixer.A_log", m_heads, keep_dtype=True)
            part.param("mixer.D", m_heads)
            part.norm("mixer.norm", m_inter)
            part.linear("mixer.out_proj", m_inter, hidden, bias=proj_bias)
        elif block == "*":
            bias = c.bool("attention_bias", False)
            attention(
                part, hidden, heads, c.int("num_key_value_heads"), head_dim, bias=bias, name="mixer"
            )
        elif block == "-":
            inter = c.int("intermediate_size")
            part.linear("mixer.up_proj", hidden, inter, bias=mlp_bias)
            part.linear("mixer.down_proj", inter, hidden, bias=mlp_bias)
        else:
            experts = c.int("n_routed_experts")
            latent = c.opt_int("moe_latent_size")
            moe_inter = c.int("moe_intermediate_size")
            part.switch("mixer.switch_mlp.fc1", latent or hidden, moe_inter, experts)
            part.switch("mixer.switch_mlp.fc2", moe_inter, latent or hidden, experts)
            moe_gate(part, experts, hidden, name="mixer.gate")
            if c.opt_int("n_shared_experts") is not None:
                shared = c.int("moe_shared_expert_intermediate_size")
                part.linear("mixer.shared_experts.up_proj", hidden, shared, bias=mlp_bias)
                part.linear("mixer.shared_experts.down_proj", shared, hidden, bias=mlp_bias)
            if latent is not None:
                part.linear("mixer.fc1_latent_proj", hidden, latent, bias=mlp_bias)
                part.linear("mixer.fc2_latent_proj", latent, hidden, bias=mlp_bias)
        layout.kinds[i] = _NEMOTRON_KINDS[block]
    add_ends(
        layout,
        "backbone.",
        c.int("vocab_size"),
        hidden,
        tied=False,
        norm="norm_f",
        embed="embeddings",
    )
    return layout
