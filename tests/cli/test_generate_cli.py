"""``mlxppd generate``: a real subprocess, the real embedded model, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from mlxppd.engine.blas import blas_in_use
from mlxppd.engine.tokenizer import encode_prompt, load_tokenizer
from tests.support.references import load_reference_model, served_weights

MLXPPD = [sys.executable, "-m", "mlxppd.cli.mlxppd_main"]


def mlxppd(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MLXPPD, *args], capture_output=True, text=True, env=env, timeout=600)


def test_json_output_matches_mlx_lm_greedy(
    embedded_model_dir: Path, cli_env: dict[str, str]
) -> None:
    question = "Explain in detail how a steam engine works."
    proc = mlxppd(
        "generate", "--pp-size", "2", "--max-tokens", "12", "--json", "-p", question, env=cli_env
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)

    tokenizer = load_tokenizer(embedded_model_dir)
    prompt = encode_prompt(tokenizer, question, chat_template=True)
    model = load_reference_model(embedded_model_dir)
    reference = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=12):
        if int(token) in tokenizer.eos_token_ids:
            break
        reference.append(int(token))
    assert len(reference) == 12 and got["tokens"] == reference
    assert got["text"] == tokenizer.decode(reference)
    # Progress and per-stage accounting go to stderr, never into the JSON.
    assert "stage 0/2: layers 0-14" in proc.stderr and "stage 1/2: layers 15-29" in proc.stderr
    # It says how it computes: float32 weights on an optimized BLAS where this host has one.
    assert f"weights: {served_weights(embedded_model_dir)}" in proc.stderr
    assert f"BLAS: {blas_in_use()}" in proc.stderr


def test_streams_the_answer_to_a_question(cli_env: dict[str, str]) -> None:
    proc = mlxppd(
        "generate",
        "--pp-layers",
        "0-9,10-19,20-29",
        "-p",
        "What is the capital of France?",
        env=cli_env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "The capital of France is Paris."


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--pp-size", "31"], "the model has 30 layers"),
        (["--pp-size", "0"], "--pp-size"),
        (["--pp-layers", ""], "no layer ranges given"),
        (["--pp-layers", "15-0,16-31"], "the start 15 is after the end 0"),
        (["--pp-layers", "0_15,16-31"], "'0_15' is not a layer range"),
        (["--pp-layers", "0-15,15-29"], "overlap on layer 15"),
        (["--pp-layers", "0-10,12-29"], "layer 11"),
        (["--pp-layers", "0-14,15-31"], "passes the last layer"),
        (["--pp-layers", "0-14,15-28"], "layer 29"),
    ],
)
def test_bad_split_is_one_line_and_exit_2(
    embedded_model_dir: Path, cli_env: dict[str, str], flags: list[str], expected: str
) -> None:
    proc = mlxppd("generate", *flags, "-p", "hi", env=cli_env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("mlxppd: error: ")
    assert expected in lines[0]
    assert proc.stdout == ""


def test_pp_size_and_pp_layers_together_are_refused(cli_env: dict[str, str]) -> None:
    proc = mlxppd("generate", "--pp-size", "2", "--pp-layers", "0-14,15-29", "-p", "x", env=cli_env)
    assert proc.returncode == 2
    assert "not allowed with argument" in proc.stderr


def test_unknown_model_type_lists_supported_families(
    tmp_path: Path, cli_env: dict[str, str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neo_x"}))
    proc = mlxppd("generate", "--model", str(tmp_path), "-p", "x", env=cli_env)
    assert proc.returncode == 2
    assert "'gpt_neo_x' has no pipeline stage executor" in proc.stderr
    assert "llama" in proc.stderr and "mistral" in proc.stderr


def test_missing_model_directory_is_a_clear_error(cli_env: dict[str, str]) -> None:
    proc = mlxppd("generate", "--model", "/nonexistent/model", "-p", "x", env=cli_env)
    assert proc.returncode == 2
    assert proc.stderr.startswith("mlxppd: error: --model:")


def test_help_explains_the_flags(cli_env: dict[str, str]) -> None:
    proc = mlxppd("generate", "--help", env=cli_env)
    assert proc.returncode == 0
    for flag in ("--pp-size", "--pp-layers", "--no-chat-template", "--json", "--seed"):
        assert flag in proc.stdout
    top = mlxppd("--help", env=cli_env)
    assert "models path" in top.stdout and "generate" in top.stdout and "serve" in top.stdout


def test_sampling_with_a_seed_is_reproducible(cli_env: dict[str, str]) -> None:
    args = ["generate", "--pp-size", "2", "-n", "6", "--temp", "0.8", "--top-p", "0.9"]
    args += ["--no-chat-template", "--seed", "7", "--json", "-p", "Tell a joke"]
    runs = [json.loads(mlxppd(*args, env=cli_env).stdout) for _ in range(2)]
    assert runs[0]["tokens"] == runs[1]["tokens"]
    assert len(runs[0]["tokens"]) > 0
