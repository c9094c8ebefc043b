"""Pricing tensors the way mlx-lm holds them in memory, from ``config.json`` alone.

A family layout (``builders``, ``mla``, ``recurrent``) names every tensor
of every block with mlx-lm's own module paths and shapes; this module turns a tensor into bytes.

Quantized modules follow mlx-lm's rules: ``Linear``, ``Embedding``, ``SwitchLinear`` and
``MultiLinear`` are quantized when their input dimension divides by the group size (and the
family's ``quant_predicate`` agrees); a per-path entry in the config's ``quantization`` table wins.
A quantized matrix of ``rows x in_dims`` costs ``rows * in_dims * bits / 8`` packed bytes plus, per
group, a scale and (affine mode) a bias in the checkpoint's float dtype; the micro-scaled modes
(mxfp4, nvfp4, mxfp8) keep one uint8 scale per group and no bias. Norms, biases and small
tensors stay in the checkpoint dtype.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import AdjacencyGroup

_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float64": 8,
}
#: the float dtype assumed when config.json names none (Hugging Face checkpoints are bf16)
DEFAULT_DTYPE_BYTES = 2
#: tensors a family keeps out of dtype casts (``cast_predicate``) are stored as float32
KEPT_DTYPE_BYTES = 4

_REQUIRED: Any = object()


class ConfigView:
    """Typed, error-reporting access to one level of a config dict (``text_config`` or the top)."""

    def __init__(self, data: Mapping[str, Any], key_prefix: str = ""):
        self.data = data
        self.key_prefix = key_prefix

    def _missing(self, key: str, what: str) -> ConfigurationError:
        return ConfigurationError(what, source="config.json", key=f"{self.key_prefix}{key}")

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def int(self, key: str, default: Any = _REQUIRED) -> int:
        value = self.data.get(key)
        if value is None:
            if default is _REQUIRED:
                raise self._missing(key, "missing; the model profile needs it to size the layers")
            return int(default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
            raise self._missing(key, f"expected a whole number, got {value!r}")
        return int(value)

    # ``int`` below is the method; annotations name the builtin explicitly.
    def opt_int(self, key: str) -> builtins.int | None:
        return None if self.data.get(key) is None else self.int(key)

    def bool(self, key: str, default: builtins.bool) -> builtins.bool:
        value = self.data.get(key)
        return default if value is None else bool(value)


@dataclass(frozen=True)
class QuantParams:
    bits: int
    group_size: int
    mode: str = "affine"


#: a family's quant_predicate: per module path, True (default params), False, or explicit params
QuantRule = Callable[[str], "bool | QuantParams"]


@dataclass(frozen=True)
class Quantization:
    """How the checkpoint's matrices are stored."""

    default: QuantParams | None = None
    #: per module path: explicit params, or None for "kept in the float dtype"
    overrides: Mapping[str, QuantParams | None] = field(default_factory=dict)
    #: Hugging Face MXFP4 checkpoints (gpt-oss) quantize only the expert tensors
    experts_only: bool = False
    #: AWQ / GPTQ exports leave the embedding and the output head in the float dtype
    skip_embedding_and_head: bool = False


def _params(entry: Mapping[str, Any], fallback: QuantParams | None) -> QuantParams:
    mode = str(entry.get("mode", fallback.mode if fallback else "affine"))
    bits = entry.get("bits", fallback.bits if fallback else 4)
    group = entry.get("group_size", fallback.group_size if fallback else 64)
    return QuantParams(bits=int(bits), group_size=int(group), mode=mode)


def quantization_from_config(config: Mapping[str, Any], notes: list[str]) -> Quantization:
    """The quantization the checkpoint uses, from mlx-lm's or Hugging Face's config keys."""
    text = config.get("text_config")
    quant = config.get("quantization")
    if not isinstance(quant, Mapping) and isinstance(text, Mapping):
        quant = text.get("quantization")
    if isinstance(quant, Mapping) and ("bits" in quant or "group_size" in quant):
        default = _params(quant, None)
        overrides: dict[str, QuantParams | None] = {}
        for key, value in quant.items():
            if isinstance(value, Mapping):
                overrides[key] = _params(value, default)
            elif isinstance(value, bool) and key not in ("bits", "group_size", "mode"):
                overrides[key] = default if value else None
        return Quantization(default=default, overrides=overrides)

    hf = config.get("quantization_config")
    if not isinstance(hf, Mapping) and isinstance(text, Mapping):
        hf = text.get("quantization_config")
    if not isinstance(hf, Mapping):
        return Quantization()
    method = str(hf.get("quant_method", ""))
    if method == "mxfp4":
        return Quantization(QuantParams(4, 32, "mxfp4"), experts_only=True)
    if method == "mxfp8":
        return Quantization(QuantParams(8, 32, "mxfp8"))
    if method == "fp8":
        if hf.get("scale_fmt") == "ue8m0" and list(hf.get("weight_block_size", ())) == [32, 32]:
            return Quantization(QuantParams(8, 32, "mxfp8"))
        # mlx-lm's sanitize dequantizes block-fp8 checkpoints to bfloat16 while loading.
        return Quantization()
    if method in ("awq", "gptq"):
        params = QuantParams(int(hf.get("bits", 4)), int(hf.get("group_size", 128)))
        return Quantization(params, skip_embedding_and_head=True)
    if method == "modelopt":
        settings = hf.get("quantization", hf)
        group = int(settings.get("group_size", 16)) if isinstance(settings, Mapping) else 16
        return Quantization(QuantParams(4, group, "nvfp4"))
    if "bits" in hf or "group_size" in hf:
        return quantization_from_config({"quantization": hf}, notes)
    notes.append(
        f"quantization method {method or 'unknown'!r} is not modelled; "
        "the estimate assumes unquantized weights"
    )
    return Quantization()


def dtype_bytes_from_config(config: Mapping[str, Any], notes: list[str]) -> int:
    """Bytes per element of the checkpoint's float tensors (norms, biases, scales)."""
    text = config.get("text_config")
    candidates = [config.get("torch_dtype"), config.get("dtype")]
    if isinstance(text, Mapping):
        candidates += [text.get("torch_dtype"), text.get("dtype")]
    for name in candidates:
        if isinstance(name, str):
            size = _DTYPE_BYTES.get(name.removeprefix("torch."))
            if size is not None:
                return size
            notes.append(f"dtype {name!r} is not known; float tensors are priced at 2 bytes")
            return DEFAULT_DTYPE_BYTES
    return DEFAULT_DTYPE_BYTES


@dataclass(frozen=True)
class Pricer:
    """Turns one tensor or module of a family layout into bytes."""

    dtype_bytes: int
    quant: Quantization
    #: the family's quant_predicate (None: every eligible module takes the default)
    rule: QuantRule | None = None

    def quant_for(self, path: str, in_dims: int, kind: str) -> QuantParams | None:
        q = self.quant
        if path in q.overrides:
            return q.overrides[path]
        if q.default is None:
            return None
        if q.experts_only and kind != "switch":
            return None
        if q.skip_embedding_and_head and (kind == "embedding" or path.endswith("lm_head")):
            return None
        # mlx-lm's converter skips a module whose input does not split into whole groups.
        if in_dims % q.default.group_size:
            return None
        verdict = True if self.rule is None else self.rule(path)
        if verdict is False:
            return None
        return verdict if isinstance(verdict, QuantParams) else q.default


class Part:
    """The tensors of one part of the model (a block, the embedding, the head), priced."""

    def __init__(self, pricer: Pricer, prefix: str):
        self.pricer = pricer
        self.prefix = prefix
        #: full checkpoint tensor name -> bytes
        self.tensors: dict[str, int] = {}

    @property
    def nbytes(self) -> int:
        return sum(self.tensors.values())

    def tensor_group(self, module: str) -> int:
        """Bytes of every tensor of one module (weight, scales, biases, bias)."""
        return sum(v for k, v in self.tensors.items() if k.rpartition(".")[0] == module)

    def _add(self, name: str, nbytes: int) -> None:
        self.tensors[self.prefix + name] = nbytes

    def param(self, name: str, *shape: int, keep_dtype: bool = False) -> None:
        """A plain float tensor; ``keep_dtype``: excluded from dtype casts (float32 in practice)."""
        size = KEPT_DTYPE_BYTES if keep_dtype else self.pricer.dtype_bytes
        self._add(name, math.prod(shape) * size)

    def norm(self, name: str, dims: int) -> None:
        self.param(f"{name}.weight", dims)

    def layer_norm(self, name: str, dims: int) -> None:
        self.param(f"{name}.weight", dims)
        self.param(f"{name}.bias", dims)

    def conv1d(self, name: str, channels: int, kernel: int, *, bias: bool = False) -> None:
        """A depthwise ``nn.Conv1d``: weight (channels, kernel, 1); never quantized."""
        self.param(f"{name}.weight", channels, kernel, 1)
        if bias:
            self.param(f"{name}.bias", channels)

    def linear(self, name: str, in_dims: int, out_dims: int, *, bias: bool = False) -> None:
        self._matrix(name, (out_dims,), in_dims, "linear")
        if bias:
            self.param(f"{name}.bias", out_dims)

    def embedding(self, name: str, num: int, dims: int) -> None:
        self._matrix(name, (num,), dims, "embedding")

    def switch(
        self, name: str, in_dims: int, out_dims: int, experts: int, *, bias: bool = False
    ) -> None:
        """A ``SwitchLinear``: ``experts`` stacked matrices; the bias stays unquantized."""
        self._matrix(name, (experts, out_dims), in_dims, "switch")
        if bias:
            self.param(f"{name}.bias", experts, out_dims)

    def multi_linear(self, name: str, in_dims: int, out_dims: int, heads: int) -> None:
        """MLA's per-head ``MultiLinear``: weight (heads, out, in)."""
        self._matrix(name, (heads, out_dims), in_dims, "multi")

    def _matrix(self, name: str, lead: tuple[int, ...], in_dims: int, kind: str) -> None:
        rows = math.prod(lead)
        q = self.pricer.quant_for(self.prefix + name, in_dims, kind)
        if q is None:
            self._add(f"{name}.weight", rows * in_dims * self.pricer.dtype_bytes)
            return
        groups = in_dims // q.group_size
        self._add(f"{name}.weight", rows * in_dims * q.bits // 8)
        if q.mode == "affine":
            self._add(f"{name}.scales", rows * groups * self.pricer.dtype_bytes)
            self._add(f"{name}.biases", rows * groups * self.pricer.dtype_bytes)
        else:
            self._add(f"{name}.scales", rows * groups)


# -- blocks shared by many families ----------------------------------------------------------


def glu_mlp(part: Part, name: str, hidden: int, inter: int, *, bias: bool = False) -> None:
    """gate_proj / up_proj / down_proj."""
    part.linear(f"{name}.gate_proj", hidden, inter, bias=bias)
    part.linear(f"{name}.up_proj", hidden, inter, bias=bias)
    part.linear(f"{name}.down_proj", inter, hidden, bias=bias)


def switch_glu(
    part: Part, name: str, hidden: int, inter: int, experts: int, *, bias: bool = False
) -> None:
    """mlx-lm's ``SwitchGLU``: every expert's gate / up / down matrices, stacked."""
    part.switch(f"{name}.gate_proj", hidden, inter, experts, bias=bias)
    part.switch(f"{name}.up_proj", hidden, inter, experts, bias=bias)
    part.switch(f"{name}.down_proj", inter, hidden, experts, bias=bias)


def attention(
    part: Part,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    bias: bool = False,
    o_bias: bool | None = None,
    qk_norm: bool = False,
    q_factor: int = 1,
    name: str = "self_attn",
) -> None:
    """q/k/v/o projections (``q_factor`` 2: a gated query, as in Qwen3-Next) and q/k norms."""
    part.linear(f"{name}.q_proj", hidden, heads * head_dim * q_factor, bias=bias)
    part.linear(f"{name}.k_proj", hidden, kv_heads * head_dim, bias=bias)
    part.linear(f"{name}.v_proj", hidden, kv_heads * head_dim, bias=bias)
    part.linear(f"{name}.o_proj", heads * head_dim, hidden, bias=bias if o_bias is None else o_bias)
    if qk_norm:
        part.norm(f"{name}.q_norm", head_dim)
        part.norm(f"{name}.k_norm", head_dim)


def router_8bit(*suffixes: str) -> QuantRule:
    """The quant_predicate several MoE families use: routers stay at 8 bits, group size 64."""
    eight = QuantParams(8, 64)

    def rule(path: str) -> bool | QuantParams:
        return eight if path.endswith(suffixes) else True

    return rule


@dataclass
class Layout:
    """A family's answer: every block priced, plus what the two ends of the pipeline hold."""

    layers: list[Part]
    kinds: list[str]
    #: what stage 0 holds besides its blocks (the token embedding, per-layer input tables)
    embedding: Part
    #: what the last stage holds besides its blocks (final norm, output head), tied table excluded
    head: Part
    #: bytes of the input table the last stage holds again as its output projection (tied)
    tied_table: int = 0
    groups: list[AdjacencyGroup] = field(default_factory=list)
    #: why the family cannot run as pipeline stages, when it cannot
    refusal: str | None = None
    notes: list[str] = field(default_factory=list)
    #: the wire family name, or a description of the fallback used
    family: str = ""


def new_layout(pricer: Pricer, family: str, layers: int, layer_prefix: str) -> Layout:
    """An empty layout with ``layers`` block parts named ``{layer_prefix}{i}.``.

    The embedding and head parts take full tensor names (``model.embed_tokens``, ``lm_head``).
    """
    return Layout(
        layers=[Part(pricer, f"{layer_prefix}{i}.") for i in range(layers)],
        kinds=[""] * layers,
        embedding=Part(pricer, ""),
        head=Part(pricer, ""),
        family=family,
    )


def add_ends(
    layout: Layout,
    prefix: str,
    vocab: int,
    hidden: int,
    *,
    tied: bool,
    norm: str = "norm",
    embed: str = "embed_tokens",
    lm_head: str = "lm_head",
) -> None:
    """The usual ends: ``{prefix}{embed}`` on stage 0; ``{prefix}{norm}`` and ``lm_head`` last.

    With tied embeddings the last stage projects through the input table, so it holds it too.
    """
    layout.embedding.embedding(f"{prefix}{embed}", vocab, hidden)
    layout.head.norm(f"{prefix}{norm}", hidden)
    if tied:
        layout.tied_table = layout.embedding.tensor_group(f"{prefix}{embed}")
    else:
        layout.head.linear(lm_head, hidden, vocab)
