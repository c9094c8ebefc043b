"""Tensor-parallel stages on MLX's own collectives (docs/tensor-parallel.md): real rank
processes joined by the ring backend over loopback.

- Token parity: a 2-stage pipeline whose stages are each sharded over the ranks by mlx-lm's own
  ``shard()`` gives, greedy, exactly mlx-lm's own tensor-parallel run over the same ranks, on
  tiny llama, qwen3 and deepseek_v3 fixtures (2 ranks); ``mlxppd generate --pp-size 2
  --tp-size 3`` on the embedded model (its 9 heads split over 3, not 2) prints mlx-lm's greedy
  tokens.
- A model whose heads do not split, or whose family mlx-lm cannot shard, is refused with its
  sentence before any rank starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from mlxppd.engine.tensor_parallel import hostfile, tp_address_warning
from mlxppd.engine.tokenizer import encode_prompt, load_tokenizer
from mlxppd.runtime.local_cluster import free_port
from tests.support.agents import VENV_BIN
from tests.support.family_cases import CASES
from tests.support.paths import REPO_ROOT
from tests.support.references import reference_tokens, served_weights

pytestmark = pytest.mark.slow

QUESTION = "Tell me a story about a dragon."
REPO = REPO_ROOT


def ranks(tp: int, module_args: list[str], env: dict[str, str]) -> list[dict[str, Any]]:
    """Run ``tests.support.tp_rank_parity`` as ``tp`` ranks; rank 0's JSON, one per model."""
    with tempfile.TemporaryDirectory() as tmp:
        hosts = Path(tmp) / "hosts.json"
        hosts.write_text(hostfile([f"127.0.0.1:{free_port()}" for _ in range(tp)]))
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.support.tp_rank_parity", *module_args],
                env={
                    **env,
                    "MLX_RANK": str(r),
                    "MLX_HOSTFILE": str(hosts),
                    "OPENBLAS_NUM_THREADS": "1",
                },
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=REPO,
            )  # fmt: skip
            for r in range(tp)
        ]
        outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err.decode()[-3000:]
    return [dict(json.loads(line)) for line in outs[0][0].decode().splitlines() if line]


def test_sharded_stages_equal_mlx_lms_own_tensor_parallel_run(
    tiny_model: Any, cli_env: dict[str, str]
) -> None:
    """On tiny llama, qwen3 and deepseek_v3 (quantized) fixtures, 2 stages x 2 ranks (one ring
    runs the three models in turn)."""
    prompt = [1, 17, 42, 99, 7, 150, 3, 64]
    families = ("llama", "qwen3", "deepseek_v3")
    models = []
    for family in families:
        config, bits, _ = CASES[family]
        if family == "deepseek_v3":
            # Quantized in groups of 32: an expert 32 wide is one group no rank can halve.
            config = {**config, "moe_intermediate_size": 64}
        models.append(str(tiny_model(f"tp-{family}", config, bits)))
    args = [os.pathsep.join(models), "0-1,2-3", "2", "16", json.dumps(prompt)]
    results = ranks(2, args, cli_env)
    assert len(results) == len(families)
    for family, got in zip(families, results, strict=True):
        assert len(got["theirs"]) == 16 and got["ours"] == got["theirs"], family


def test_generate_runs_the_embedded_model_over_2_stages_of_3_ranks(
    embedded_model_dir: Path, cli_env: dict[str, str]
) -> None:
    """The command a user runs: the launcher starts the 3 ranks (the embedded model's 9 heads
    and 3 KV heads split over 3, not 2), rank 0 prints; its greedy tokens are mlx-lm's."""
    tokenizer = load_tokenizer(embedded_model_dir)
    prompt = encode_prompt(tokenizer, QUESTION, chat_template=True)
    # Few tokens: three ranks of the embedded model on two cores are slow (the note of issue 25
    # reports 64 of 64 by hand).
    expected = reference_tokens(
        embedded_model_dir, prompt, 4, weights=served_weights(embedded_model_dir)
    )
    run = subprocess.run(
        [str(VENV_BIN / "mlxppd"), "generate", "--pp-size", "2", "--tp-size", "3", "-n", "4",
         "--json", "-p", QUESTION],
        env=cli_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    printed = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(printed) == 1 and printed[0]["tokens"] == expected
    assert "tensor-parallel rank 0 of 3" in run.stderr


def test_models_that_cannot_be_sharded_are_refused_with_their_sentence(
    tiny_model: Any, cli_env: dict[str, str]
) -> None:
    def refused(*flags: str, serve: bool = False) -> str:
        # generate and serve's local cluster refuse alike, before any process starts.
        stderr = []
        commands = [["generate", "-p", "Hi"]] + ([["serve", "--port", "0"]] if serve else [])
        for command in commands:
            run = subprocess.run(
                [str(VENV_BIN / "mlxppd"), *command, "--pp-size", "2", *flags],
                env=cli_env, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert run.returncode == 2, run.stderr
            assert "starting stage" not in run.stderr
            stderr.append(run.stderr)
        assert all(e.splitlines()[-1] == stderr[0].splitlines()[-1] for e in stderr), stderr
        return stderr[0]

    heads = refused("--tp-size", "2", serve=True)  # the embedded model: 9 heads, 3 KV heads
    assert "num_attention_heads = 9 of model_type 'llama' does not split over 2" in heads
    assert "(1, 3)" in heads
    gemma = tiny_model("tp-gemma3", CASES["gemma3_text"][0])
    family = refused("--tp-size", "2", "--model", str(gemma))
    assert "model_type 'gemma3_text' has no tensor-parallel sharding in mlx-lm" in family


def test_serve_takes_tp_size_for_a_local_cluster_only(cli_env: dict[str, str]) -> None:
    def error(*flags: str) -> str:
        run = subprocess.run(
            [str(VENV_BIN / "mlxppd"), "serve", "--port", "0", *flags],
            env=cli_env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 2, run.stderr
        return run.stderr

    alone = error("--tp-size", "3")
    assert "--tp-size" in alone and "add --pp-size 2 (or more)" in alone
    elastic = error("--pp-size", "2", "--tp-size", "3", "--enable-elastic-pp")
    assert "cannot move them while serving; drop --enable-elastic-pp or --tp-size" in elastic


def test_a_tp_peer_off_private_networks_is_named() -> None:
    for private in ("127.0.0.1", "10.1.2.3", "192.168.0.7", "169.254.3.4", "fd00::1", "node-a"):
        assert tp_address_warning(private) is None
    warning = tp_address_warning("8.8.8.8")
    assert warning is not None and "8.8.8.8" in warning and "not encrypted" in warning
