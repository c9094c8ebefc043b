"""Shared fixtures: the embedded real model (converted into a per-session cache) and tiny models."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """Before any test module imports mlx: compute on the optimized BLAS, as mlxppd does.

    Under pytest-xdist every worker gives the local clusters it starts a port range of its
    own, none of them the default one (39600-39629: a zero-config bring-up's control port in
    any worker is 39600), so no two tests race for the same first free port; a run without
    xdist takes a range by its process id, so two runs at once do not race either."""
    from mlxppd.engine.blas import use_optimized_blas

    use_optimized_blas()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        first = 39700 + 100 * int(worker[2:])
        os.environ["MLXPP_TRANSPORT_PORT_RANGE"] = f"{first}-{first + 29}"
    elif "MLXPP_TRANSPORT_PORT_RANGE" not in os.environ:
        # Two pytest runs at once (no xdist) must not race for the default range either.
        first = 42000 + 30 * (os.getpid() % 300)
        os.environ["MLXPP_TRANSPORT_PORT_RANGE"] = f"{first}-{first + 29}"


#: the modules that keep one xdist worker busiest, slowest first (``pytest --durations=0``
#: summed per file on 2 cores). ``scripts/test.sh`` runs them first, with xdist's reordering
#: off: the two workers then take the rest as they come free and finish together, instead of
#: one of them starting a three-minute cluster module last while the other idles.
SLOW_MODULES = (
    "test_failover.py",
    "test_console.py",
    "test_sampling_api.py",
    "test_failover_cascade.py",
    "test_openapi.py",
    "test_http_attacks.py",
    "test_prepare_attacks.py",
    "test_adapters_serve.py",
    "test_zero_config.py",
    "test_serve_cluster.py",
    "test_adapter_families.py",
    "test_tensor_parallel.py",
    "test_elastic_cluster.py",
    "test_tp_serving.py",
    "test_generate_cli.py",
    "test_agent_cluster.py",
    "test_tool_length_cut.py",
    "test_ollama_api.py",
    "test_http_api.py",
    "test_ctl_admin.py",
    "test_responses_api.py",
    "test_stage_parity.py",
    "test_early_close.py",
    "test_prepare_cluster.py",
    "test_https.py",
    "test_instructor.py",
    "test_anthropic_api.py",
    "test_recovery_cascade.py",
    "test_constrained_replay.py",
    "test_anthropic_sdk.py",
    "test_serve_cli.py",
    "test_partition_generate.py",
    "test_family_parity.py",
    "test_chunked_prefill.py",
    "test_top_logprobs_batching.py",
    "test_grammar.py",
    "test_grammar_attack.py",
    "test_cors.py",
    "test_local_cluster_supervision.py",
    "test_sequence_isolation.py",
    "test_observability.py",
    "test_admin_openapi.py",
    "test_stage_port_flood.py",
    "test_micro_batch_members.py",
    "test_tp_agents.py",
    "test_launch_warnings.py",
    "test_agent_process.py",
    "test_code_shape.py",
    "test_openai_agents.py",
    "test_openai_client.py",
    "test_stage_memory.py",
    "test_grammar_admission.py",
    "test_openai_sdk.py",
    "test_prompt_cache_moves.py",
    "test_embedded_model.py",
    "test_litellm.py",
    "test_pydantic_ai.py",
    "test_cpu_weights.py",
    "test_serve_flags.py",
    "test_recovery_order.py",
    "test_coordinator_takeover.py",
    "test_unserved_paths.py",
    "test_mlx_cache.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_MODULES)}
    # A stable sort: each module's tests keep their order (its module fixtures run once).
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_MODULES)))


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model cache private to this test session (the user's ~/.cache is never touched)."""
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def embedded_model_dir(model_cache: Path) -> Path:
    from mlxppd.engine.embedded import ensure_embedded_model

    return ensure_embedded_model(model_cache)


@pytest.fixture()
def cli_env(model_cache: Path) -> dict[str, str]:
    """Environment for mlxppd subprocesses: the session's model cache, no hub access."""
    env = dict(os.environ)
    env["MLXPP_MODEL_CACHE"] = str(model_cache)
    env["HF_HUB_OFFLINE"] = "1"
    return env


def write_tiny_model(
    path: Path, config: dict[str, Any], *, quantize_bits: int | None = None, seed: int = 0
) -> Path:
    """A random-weight mlx-lm model directory built by mlx-lm's own model class."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import _get_classes

    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    # Default init makes greedy decoding collapse onto one token; larger matrices give varied
    # continuations, so a parity test compares something.
    model.update(tree_map(lambda p: p * 4 if p.ndim >= 2 else p, model.parameters()))
    config = dict(config)
    if quantize_bits is not None:
        nn.quantize(model, group_size=32, bits=quantize_bits)
        config["quantization"] = {"group_size": 32, "bits": quantize_bits}
    path.mkdir(parents=True, exist_ok=True)
    weights = {f"{k}": v for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


# A tiny llama that shards over 2 tensor-parallel ranks and speaks through the embedded
# model's tokenizer (its vocabulary), so the chat API can serve it.
def _chat_llama() -> dict[str, Any]:
    from tests.support.family_cases import CASES

    return {**CASES["llama"][0], "vocab_size": 49152}


@pytest.fixture(scope="session")
def chat_llama(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> Path:
    """The family fixtures' tiny llama (4 heads, 2 KV heads) with the embedded model's
    vocabulary and tokenizer files."""
    import shutil

    model = write_tiny_model(tmp_path_factory.mktemp("chat-llama"), _chat_llama())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(embedded_model_dir / name, model / name)
    return model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``tiny_model(name, config, quantize_bits=None)`` -> model directory (cached)."""
    made: dict[str, Path] = {}

    def make(name: str, config: dict[str, Any], quantize_bits: int | None = None) -> Path:
        if name not in made:
            made[name] = write_tiny_model(
                tmp_path_factory.mktemp(name), config, quantize_bits=quantize_bits
            )
        return made[name]

    return make
