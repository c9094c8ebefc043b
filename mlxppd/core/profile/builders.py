"""Block layouts of the attention families: what mlx-lm's model class builds, tensor by tensor.

Each builder mirrors ``mlx_lm/models/<family>.py``: the same module paths, shapes, defaults and
conditions (which layers are MoE, which keep their own K/V), so that the profile prices exactly
the blocks mlx-lm instantiates. MLA families live in ``mla``, the recurrent families (SSM /
linear-attention blocks beside attention blocks) in ``recurrent``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import AdjacencyGroup
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


def _nested(config: Mapping[str, Any]) -> tuple[ConfigView, str]:
    """The text config and its key prefix for error messages (flat configs are their own)."""
    text = config.get("text_config")
    if isinstance(text, Mapping):
        return ConfigView(text, "text_config."), "language_model."
    return ConfigView(config), ""


def llama(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    """llama.py (also model_type mistral): dense GQA blocks."""
    c = ConfigView(config)
    hidden, n = c.int("hidden_size"), c.int("num_hidden_layers")
    heads = c.int("num_attention_heads")
    kv = c.int("num_key_value_heads", heads)
    head_dim = c.int("head_dim", hidden // heads)
    inter = c.int("intermediate_size")
    attn_bias, mlp_bias = c.bool("attention_bias", False), c.bool("mlp_bias", False)
    layout = new_layout(pricer, "llama", n, "model.layers.")
    for i, part in enumerate(layout.layers):
        attention(part, hidden, heads, kv, head_dim, bias=attn_bias)
        glu_mlp(part, "mlp", hidden, inter, bias=mlp_bias)
        part.norm("input_layernorm", hidden)
        part.norm("post_attention_layernorm", hidden)
        layout.kinds[i] = "attention+mlp"
    tied = c.bool("tie_word_embeddings", True)
    add_ends(layout, "model.", c.int("vocab_size"), hidden, tied=tied)
    return layout


def mixtral(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    """mixtral.py: every block is MoE (``num_local_experts`` experts in one SwitchGLU)."""
    c = ConfigView(config)
    hidden, n = c.int("hidden_size", 4096), c.int("num_hidden_layers", 32)
    heads = c.int("num_attention_heads", 32)
    kv = c.int("num_key_value_heads", 8)
    inter, experts = c.int("intermediate_size", 14336), c.int("num_local_experts", 8)
    layout = new_layout(pricer, "mixtral", n, "model.layers.")
    for i, part in enumerate(layout.layers):
        # mixtral.py derives head_dim from hidden_size and ignores a head_dim key.
        attention(part, hidden, heads, kv, hidden // heads)
        part.linear("block_sparse_moe.gate", hidden, experts)
        switch_glu(part, "block_sparse_moe.switch_mlp", hidden, inter, experts)
        part.norm("input_layernorm", hidden)
        part.norm("post_attention_layernorm", hidden)
        layout.kinds[i] = "attention+moe"
    tied = c.bool("tie_word_embeddings", False)
    add_ends(layout, "model.", c.int("vocab_size", 32000), hidden, tied=tied)
    return layout


def llama4(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    """llama4.py, the text tower: every ``interleave_moe_layer_step``-th block is MoE.

    MoE blocks hold ``num_local_experts`` experts of ``intermediate_size`` plus a shared expert;
    dense blocks use ``intermediate_size_mlp``.
    """
    c, _ = _nested(config)
    hidden, n = c.int("hidden_size"), c.int("num_hidden_layers")
    heads, kv = c.int("num_attention_heads"), c.int("num_key_value_heads")
    head_dim = c.int("head_dim", hidden // heads)
    inter, inter_mlp = c.int("intermediate_size"), c.int("intermediate_size_mlp")
    step, experts = c.int("interleave_moe_layer_step"), c.int("num_local_experts")
    bias = c.bool("attention_bias", False)
    layout = new_layout(pricer, "llama4", n, "language_model.model.layers.")
    for i, part in enumerate(layout.layers):
        attention(part, hidden, heads, kv, head_dim, bias=bias)
        if i % step == step - 1:
            switch_glu(part, "feed_forward.experts", hidden, inter, experts)
            part.linear("feed_forward.router", hidden, experts)
            glu_mlp(part, "feed_forward.shared_expert", hidden, inter)
            layout.kinds[i] = "attention+moe"
        else:
            glu_mlp(part, "feed_forward", hidden, inter_mlp)
            layout.kinds[i] = "attention+mlp"
        part.norm("input_layernorm", hidden)
        part.norm("post_attention_layernorm", hidden)
    vocab = c.int("vocab_size")
    lm_head = "language_model.lm_head"
    add_ends(layout, "language_model.model.", vocab, hidden, tied=False, lm_head=lm_head)
    return layout


def llama4_text(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    """llama4_text.py: a dense tower whose blocks all use ``intermediate_size_mlp``."""
    c = ConfigView(config)
    hidden, n = c.int("hidden_size"), c.int("num_hidden_layers")
    heads, kv, head_dim = (
        c.int("num_attention_heads"),
        c.int("num_key_value_heads"),
        c.int("head_dim"),
    )
    inter = c.int("intermediate_size_mlp")
    layout = new_layout(pricer, "llama4", n, "model.layers.")
    for i, part in enumerate(layout.layers):
        attention(part, hidden, heads, kv, head_dim)
        glu_mlp(part, "feed_forward", hidden, inter)
        part.norm("input_layernorm", hidden)
        part.norm("post_attention_layernorm", hidden)
        layout.kinds[i] = "attention+mlp"
    tied = c.bool("tie_word_embeddings", False)
    add_ends(layout, "model.", c.int("vocab_size"), hidden, tied=tied, lm_head="output")
    return layout


def gpt_oss(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    """gpt_oss.py: biased attention with sinks, every block MoE with biased experts."""
    c = ConfigView(config)
    pricer = dataclasses.replace(pricer, rule=router_8bit("router"))
    hidden, n = c.int("hidden_size", 2880), c.int("num_hidden_layers", 36)
    heads, kv = c.int("num_attention_heads", 64), c.int("num_key_value_heads", 8)
    head_dim, inter = c.int("head_dim", 64), c.int("intermediate_size", 2880)
    experts = c.int("num_local_experts", 128)
    layout = new_layout(pricer, "gpt_oss", n, "model.layers.")
    for i, part in enumerate(layout.layers):
        attention(part, hidden, heads, kv, head_dim, bias=True)
        part.param("self_attn.sinks", heads)
        switch_glu(part, "mlp.experts", hidden, inter, experts, bias=True)
        part.linear("mlp.router", hidden, experts, bias=True)
        part.norm("input_layernorm", hidden)
        part.norm("post_attention_layernorm", hidden)
        layout.kinds[i] = "attention+moe"
    add_ends(layout, "model.", c.int("vocab_size", 201088), hidden, tied=False)
    return layout


_GEMMA_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def _gemma_text(config: Mapping[str, Any], *, vocab: int, kv_heads: int) -> tuple[ConfigView, str]:
    """The text config of a Gemma model and its key prefix.

    A VLM config nests it under ``text_config``; mlx-lm's wrapper then takes ``vocab_size`` from
    the top level (``vocab`` when absent) and defaults the head counts its own way.
    """
    if not isinstance(config.get("text_config"), Mapping):
        return ConfigView(config), ""
    text = dict(config["text_config"])
    text["vocab_size"] = config.get("vocab_size") or vocab
    text.setdefault("num_attention_heads", 8)
    text.setdefault("num_key_value_heads", kv_heads)
    return ConfigView(text, "text_config."), "language_model."


def gemma3(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    """gemma3_text.py (and gemma3.py's text tower): 4 norms per block, q/k norms, tied head.

    mlx-lm ties the head when the checkpoint has no ``lm_head.weight``; Gemma 3 checkpoints
    ship without one, so the profile ties unless ``tie_word_embeddings`` is false.
    """
    c, prefix = _gemma_text(config, vocab=262208, kv_heads=4)
    hidden, n = c.int("hidden_size", 1152), c.int("num_hidden_layers", 26)
    heads, kv = c.int("num_attention_heads", 4), c.int("num_key_value_heads", 1)
    head_dim, inter = c.int("head_dim", 256), c.int("intermediate_size", 6912)
    layout = new_layout(pricer, "gemma3", n, f"{prefix}model.layers.")
    for i, part in enumerate(layout.layers):
        attention(part, hidden, heads, kv, head_dim, qk_norm=True)
        glu_mlp(part, "mlp", hidden, inter)
        for norm in _GEMMA_NORMS:
            part.norm(norm, hidden)
        layout.kinds[i] = "attention+mlp"
    tied = ConfigView(config).bool("tie_word_embeddings", c.bool("tie_word_embeddings", True))
    vocab = c.int("vocab_size", 262144)
    add_ends(layout, f"{prefix}model.", vocab, hidden, tied=tied, lm_head=f"{prefix}lm_head")
    return layout


def gemma4(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    """gemma4_text.py (and gemma4.py's text tower).

    The last ``num_kv_shared_layers`` blocks compute no K/V: each reads the cache of the last
    earlier block of its ``layer_types`` kind, which makes every (source, consumer) pair an
    adjacency group. With ``use_double_wide_mlp`` those consumer blocks carry a 2x MLP. Stage 0
    also holds the per-layer input tables (``embed_tokens_per_layer`` and its projection): it
    computes every block's per-layer input and ships them downstream with the hidden states.
    """
    c, prefix = _gemma_text(config, vocab=262144, kv_heads=1)
    pricer = dataclasses.replace(pricer, rule=router_8bit("router.proj"))
    hidden, n = c.int("hidden_size", 1536), c.int("num_hidden_layers", 35)
    heads, kv = c.int("num_attention_heads", 8), c.int("num_key_value_heads", 1)
    head_dim, global_head_dim = c.int("head_dim", 256), c.int("global_head_dim", 512)
    attn = _Gemma4Attention(
        hidden,
        heads,
        kv,
        head_dim,
        global_head_dim,
        global_kv=c.opt_int("num_global_key_value_heads"),
        k_eq_v=c.bool("attention_k_eq_v", False),
    )
    inter = c.int("intermediate_size", 6144)
    shared = c.int("num_kv_shared_layers", 20)
    double_wide = c.bool("use_double_wide_mlp", True)
    per_layer = c.int("hidden_size_per_layer_input", 256)
    moe = c.bool("enable_moe_block", False)
    layer_types = _gemma4_layer_types(c, n)
    first_shared = n - shared

    layout = new_layout(pricer, "gemma4", n, f"{prefix}model.layers.")
    for i, part in enumerate(layout.layers):
        has_kv = i < first_shared
        attn.add(part, sliding=layer_types[i] == "sliding_attention", has_kv=has_kv)
        wide = double_wide and i >= first_shared > 0
        glu_mlp(part, "mlp", hidden, inter * (2 if wide else 1))
        for norm in _GEMMA_NORMS:
            part.norm(norm, hidden)
        if moe:
            _gemma4_moe(part, c, hidden)
        if per_layer:
            part.linear("per_layer_input_gate", hidden, per_layer)
            part.linear("per_layer_projection", per_layer, hidden)
            part.norm("post_per_layer_input_norm", hidden)
        part.param("layer_scalar", 1)
        kind = "attention" if has_kv else "kv-shared attention"
        layout.kinds[i] = f"{kind}+{'moe' if moe else 'mlp'}"

    if shared > 0:
        layout.groups.extend(_gemma4_kv_groups(c, layer_types, first_shared, n))
    _gemma4_ends(layout, c, prefix, hidden, per_layer)
    return layout


@dataclasses.dataclass(frozen=True)
class _Gemma4Attention:
    """Gemma 4's attention: full-attention blocks use their own head size and K/V head count."""

    hidden: int
    heads: int
    kv: int
    head_dim: int
    global_head_dim: int
    global_kv: int | None
    k_eq_v: bool

    def add(self, part: Part, *, sliding: bool, has_kv: bool) -> None:
        """The block's attention tensors; a KV-shared block has no K/V projections or norm."""
        dim = self.global_head_dim if not sliding and self.global_head_dim else self.head_dim
        use_k_eq_v = self.k_eq_v and not sliding
        n_kv = self.global_kv if use_k_eq_v and self.global_kv is not None else self.kv
        part.linear("self_attn.q_proj", self.hidden, self.heads * dim)
        part.linear("self_attn.o_proj", self.heads * dim, self.hidden)
        part.norm("self_attn.q_norm", dim)
        if has_kv:
            part.linear("self_attn.k_proj", self.hidden, n_kv * dim)
            if not use_k_eq_v:
                part.linear("self_attn.v_proj", self.hidden, n_kv * dim)
            part.norm("self_attn.k_norm", dim)


def _gemma4_layer_types(c: ConfigView, n: int) -> Sequence[str]:
    """``layer_types``, or the ``sliding_window_pattern`` it defaults to."""
    layer_types: Sequence[str] | None = c.get("layer_types")
    if layer_types is None:
        pattern_len = c.int("sliding_window_pattern", 5)
        pattern = ["sliding_attention"] * (pattern_len - 1) + ["full_attention"]
        layer_types = (pattern * (n // len(pattern) + 1))[:n]
    if len(layer_types) < n:
        raise ConfigurationError(
            f"has {len(layer_types)} entries for {n} layers",
            source="config.json",
            key="layer_types",
        )
    return layer_types


def _gemma4_moe(part: Part, c: ConfigView, hidden: int) -> None:
    """The MoE branch a block carries next to its dense MLP (``enable_moe_block``)."""
    experts = c.int("num_experts")
    part.linear("router.proj", hidden, experts)
    part.param("router.scale", hidden)
    part.param("router.per_expert_scale", experts)
    switch_glu(part, "experts.switch_glu", hidden, c.int("moe_intermediate_size"), experts)
    for norm in (
        "post_feedforward_layernorm_1",
        "post_feedforward_layernorm_2",
        "pre_feedforward_layernorm_2",
    ):
        part.norm(norm, hidden)


def _gemma4_kv_groups(
    c: ConfigView, layer_types: Sequence[str], first_shared: int, n: int
) -> list[AdjacencyGroup]:
    """One group per KV-shared block and the last earlier block of its kind it reads."""
    last_of_kind = {layer_types[i]: i for i in range(first_shared)}
    groups = []
    for j in range(first_shared, n):
        source = last_of_kind.get(layer_types[j])
        if source is None:
            raise ConfigurationError(
                f"KV-shared layer {j} is {layer_types[j]!r} but no earlier layer of that kind "
                "holds a cache to share",
                source="config.json",
                key=f"{c.key_prefix}layer_types",
            )
        groups.append(AdjacencyGroup(source, j, f"layer {j} reads the KV cache of layer {source}"))
    return groups


def _gemma4_ends(layout: Layout, c: ConfigView, prefix: str, hidden: int, per_layer: int) -> None:
    """Embedding and head, plus the per-layer input tables stage 0 holds."""
    n = len(layout.layers)
    tied = c.bool("tie_word_embeddings", True)
    model = f"{prefix}model."
    add_ends(
        layout, model, c.int("vocab_size", 262144), hidden, tied=tied, lm_head=f"{prefix}lm_head"
    )
    if per_layer:
        vocab_per_layer = c.int("vocab_size_per_layer_input", 262144)
        layout.embedding.embedding(f"{model}embed_tokens_per_layer", vocab_per_layer, n * per_layer)
        layout.embedding.linear(f"{model}per_layer_model_projection", hidden, n * per_layer)
        layout.embedding.norm(f"{model}per_layer_projection_norm", per_layer)


def glm4(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    """glm4.py: fused gate_up MLP and four norms per block; always an untied head."""
    c = ConfigView(config)
    hidden, n = c.int("hidden_size"), c.int("num_hidden_layers")
    heads, kv = c.int("num_attention_heads"), c.int("num_key_value_heads")
    head_dim = c.int("head_dim", hidden // heads)
    inter, bias = c.int("intermediate_size"), c.bool("attention_bias", False)
    layout = new_layout(pricer, "glm4", n, "model.layers.")
    for i, part in enumerate(layout.layers):
        attention(part, hidden, heads, kv, head_dim, bias=bias, o_bias=False)
        part.linear("mlp.gate_up_proj", hidden, 2 * inter)
        part.linear("mlp.down_proj", inter, hidden)
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "post_self_attn_layernorm",
            "post_mlp_layernorm",
        ):
            part.norm(norm, hidden)
        layout.kinds[i] = "attention+mlp"
    add_ends(layout, "model.", c.int("vocab_size"), hidden, tied=False)
    return layout


def moe_gate(part: Part, experts: int, hidden: int, name: str = "mlp.gate") -> None:
    """DeepSeek-style ``MoEGate``: a plain weight (never quantized) and a float32 bias."""
    part.param(f"{name}.weight", experts, hidden)
    part.param(f"{name}.e_score_correction_bias", experts, keep_dtype=True)


def glm4_moe(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    """glm4_moe.py: blocks from ``first_k_dense_replace`` on are MoE with shared experts."""
    c = ConfigView(config)
    hidden, n = c.int("hidden_size"), c.int("num_hidden_layers")
    heads, kv, head_dim = (
        c.int("num_attention_heads"),
        c.int("num_key_value_heads"),
        c.int("head_dim"),
    )
    bias, qk_norm = c.bool("attention_bias", False), c.bool("use_qk_norm", False)
    experts = c.opt_int("n_routed_experts")
    n_shared = c.opt_int("n_shared_experts")
    first_dense = c.int("first_k_dense_replace", 0)
    layout = new_layout(pricer, "glm4", n, "model.layers.")
    for i, part in enumerate(layout.layers):
        attention(part, hidden, heads, kv, head_dim, bias=bias, o_bias=False, qk_norm=qk_norm)
        if experts is not None and i >= first_dense:
            moe_inter = c.int("moe_intermediate_size")
            switch_glu(part, "mlp.switch_mlp", hidden, moe_inter, experts)
            moe_gate(part, experts, hidden)
            if n_shared is not None:
                glu_mlp(part, "mlp.shared_experts", hidden, moe_inter * n_shared)
            layout.kinds[i] = "attention+moe"
        else:
            glu_mlp(part, "mlp", hidden, c.int("intermediate_size"))
            layout.kinds[i] = "attention+mlp"
        part.norm("input_layernorm", hidden)
        part.norm("post_attention_layernorm", hidden)
    add_ends(layout, "model.", c.int("vocab_size"), hidden, tied=False)
    return layout


def qwen3(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    """qwen3.py: dense blocks with q/k norms."""
    c = ConfigView(config)
    hidden, n = c.int("hidden_size"), c.int("num_hidden_layers")
    heads, kv = c.int("num_attention_heads"), c.int("num_key_value_heads")
    head_dim = c.int("head_dim", hidden // heads)
    layout = new_layout(pricer, "qwen3", n, "model.layers.")
    for i, part in enumerate(layout.layers):
        attention(part, hidden, heads, kv, head_dim, qk_norm=True)
        glu_mlp(part, "mlp", hidden, c.int("intermediate_size"))
        part.norm("input_layernorm", hidden)
        part.norm("post_attention_layernorm", hidden)
        layout.kinds[i] = "attention+mlp"
    tied = c.bool("tie_word_embeddings", False)
    add_ends(layout, "model.", c.int("vocab_size"), hidden, tied=tied)
    return layout


def dense_fallback(config: Mapping[str, Any], pricer: Pricer) -> Layout:
    """Any other model: priced as llama-like dense blocks (MoE when it names an expert count)."""
    c, prefix = _nested(config)
    hidden, n = c.int("hidden_size"), c.int("num_hidden_layers")
    heads = c.int("num_attention_heads")
    kv = c.int("num_key_value_heads", heads)
    head_dim = c.int("head_dim", hidden // heads)
    inter = c.int("intermediate_size", 4 * hidden)
    experts = c.opt_int("num_local_experts") or c.opt_int("num_experts") or 0
    layout = new_layout(pricer, "", n, f"{prefix}model.layers.")
    for i, part in enumerate(layout.layers):
        attention(part, hidden, heads, kv, head_dim)
        if experts > 1:
            moe_inter = c.int("moe_intermediate_size", inter)
            part.linear("mlp.gate", hidden, experts)
            switch_glu(part, "mlp.switch_mlp", hidden, moe_inter, experts)
            layout.kinds[i] = "attention+moe"
        else:
            glu_mlp(part, "mlp", hidden, inter)
            layout.kinds[i] = "attention+mlp"
        part.norm("input_layernorm", hidden)
        part.norm("post_attention_layernorm", hidden)
    tied = c.bool("tie_word_embeddings", False)
    vocab = c.int("vocab_size")
    add_ends(layout, f"{prefix}model.", vocab, hidden, tied=tied, lm_head=f"{prefix}lm_head")
    model_type = config.get("model_type")
    layout.family = f"{model_type} (priced as llama-like blocks)"
    layout.notes.append(
        f"model_type {model_type!r} has no dedicated profile; its blocks are priced as "
        "llama-like attention + MLP, so treat the estimate as approximate"
    )
    return layout
