"""The embedded default model: converted once, atomically, and loadable by mlx-lm itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from mlxppd.engine.embedded import EMBEDDED_MODEL_NAME, ensure_embedded_model
from tests.support.paths import REPO_ROOT

REPO = REPO_ROOT
NOBODY = 65534


def test_converted_directory_loads_in_mlx_lm_and_answers(embedded_model_dir: Path) -> None:
    from mlx_lm import generate, load

    model, tokenizer = load(str(embedded_model_dir))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    answer = generate(model, tokenizer, prompt, max_tokens=20)
    assert answer.strip() == "The capital of France is Paris."


def test_config_matches_the_gguf_facts(embedded_model_dir: Path) -> None:
    config = json.loads((embedded_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0
    assert config["rope_traditional"] is True
    # Blocks are 4-bit; the GGUF keeps the embedding table at 8 bits, recorded per module.
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["group_size"] == 32
    assert config["quantization"]["model.embed_tokens"] == {"bits": 8, "group_size": 32}


def test_second_call_reuses_the_directory(embedded_model_dir: Path, model_cache: Path) -> None:
    before = (embedded_model_dir / "model.safetensors").stat().st_mtime_ns
    messages: list[str] = []
    assert ensure_embedded_model(model_cache, messages.append) == embedded_model_dir
    assert messages == []  # nothing converted, nothing to report
    assert (embedded_model_dir / "model.safetensors").stat().st_mtime_ns == before


def _models_path(cache: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    env = {**env, "MLXPP_MODEL_CACHE": str(cache)}
    return subprocess.Popen(
        [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "models", "path"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_concurrent_first_calls_convert_once(tmp_path: Path, cli_env: dict[str, str]) -> None:
    procs = [_models_path(tmp_path, cli_env) for _ in range(3)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1
    target = Path(paths.pop())
    assert target.name.startswith(EMBEDDED_MODEL_NAME)
    # Exactly one process converted (and showed progress); the others waited and reused it.
    converting = [err for _, err in results if "converting" in err]
    assert len(converting) == 1
    assert "[4/4" in converting[0]
    # Nothing half-written is left beside the model.
    models = target.parent
    assert sorted(p.name for p in models.iterdir() if p.is_dir()) == [target.name]


def test_a_killed_conversion_is_never_used(tmp_path: Path, cli_env: dict[str, str]) -> None:
    # A real crash: the converting process SIGKILLs itself while writing the weights.
    crash = textwrap.dedent(
        f"""
        import os, signal
        from pathlib import Path
        from mlxppd.engine.embedded import ensure_embedded_model
        def progress(msg):
            if msg.startswith("[3/4"):
                os.kill(os.getpid(), signal.SIGKILL)
        ensure_embedded_model(Path({str(tmp_path)!r}), progress)
        """
    )
    proc = subprocess.run([sys.executable, "-c", crash], env=cli_env, timeout=300)
    assert proc.returncode == -9
    models = tmp_path / "models"
    leftovers = [p for p in models.iterdir() if p.is_dir()]
    assert leftovers and all(p.name.startswith(".") for p in leftovers)  # only the temp dir

    target = ensure_embedded_model(tmp_path)
    assert (target / "config.json").is_file()
    assert sorted(p.name for p in models.iterdir() if p.is_dir()) == [target.name]


def test_models_path_prints_the_directory(
    embedded_model_dir: Path, model_cache: Path, cli_env: dict[str, str]
) -> None:
    proc = _models_path(model_cache, cli_env)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.strip() == str(embedded_model_dir)


@pytest.mark.skipif(os.geteuid() != 0, reason="switches to an unprivileged user: needs root")
def test_a_read_only_gguf_converts_for_an_unprivileged_service_user() -> None:
    """mlx's GGUF reader opens its file for writing; a service user converting from a package
    installed read-only must still get the model (it reads a private copy)."""
    from mlxppd.engine.embedded import embedded_gguf_path

    # Outside pytest's root-only tmp tree: the service user must reach these directories.
    work = Path(tempfile.mkdtemp(prefix="mlxpp-ro-"))
    try:
        work.chmod(0o755)
        gguf = work / embedded_gguf_path().name
        shutil.copyfile(embedded_gguf_path(), gguf)
        gguf.chmod(0o444)
        out = work / "out"
        out.mkdir()
        os.chown(out, NOBODY, NOBODY)
        script = (
            "import sys; from pathlib import Path; from mlxppd.engine.embedded import "
            "convert_gguf; convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]), lambda s: None)"
        )
        subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             sys.executable, "-c", script, str(gguf), str(out)],
            check=True, cwd=REPO, timeout=600,
        )  # fmt: skip
        assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 30
        assert (out / "model.safetensors").stat().st_size > 0
    finally:
        shutil.rmtree(work)
