"""``mlxppctl plan``: the shard plan preview, from config.json alone, as text or JSON."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.checkpoint_configs import GEMMA4_E2B, LLAMA_8B_4BIT
from tests.support.profile_cases import CASES

MLXPPCTL = [sys.executable, "-m", "mlxppd.cli.mlxppctl_main"]
GiB = 2**30


def mlxppctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real command in its own process (its entry point, ``--help``, the default model)."""
    return subprocess.run([*MLXPPCTL, *args], capture_output=True, text=True, env=env, timeout=300)


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    """``mlxppctl plan ARGS``, run by the same ``main()`` in this process: what it prints on
    stdout and stderr and the exit code it returns (or exits with, as argparse does). A fresh
    process per case only paid the interpreter's and the imports' start-up again."""
    from mlxppd.cli.mlxppctl_main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["plan", *args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(
        ["mlxppctl", "plan", *args], code, out.getvalue(), err.getvalue()
    )


def config_file(tmp_path: Path, config: dict[str, Any], name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("mlxppctl: error: ")
    assert proc.stdout == ""
    return lines[0]


def test_json_plan_has_the_documented_shape(tmp_path: Path) -> None:
    model = config_file(tmp_path, LLAMA_8B_4BIT)
    proc = plan("--model", str(model), "--pp-size", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert list(doc) == [
        "stages",
        "layer_bytes",
        "embedding_bytes",
        "lm_head_bytes",
        "adjacency_groups",
        "imbalance",
        "warnings",
    ]
    first, last = doc["stages"]
    assert list(first) == [
        "stage_index",
        "layer_range",
        "has_embedding",
        "has_lm_head",
        "estimated_memory_bytes",
        "budget_bytes",
    ]
    # Half-open ranges, stage 0 with the embedding, the last stage with the head.
    assert first["layer_range"] == [0, 16] and last["layer_range"] == [16, 32]
    assert (first["has_embedding"], first["has_lm_head"]) == (True, False)
    assert (last["has_embedding"], last["has_lm_head"]) == (False, True)
    assert first["budget_bytes"] is None
    assert len(doc["layer_bytes"]) == 32
    assert first["estimated_memory_bytes"] == doc["embedding_bytes"] + sum(doc["layer_bytes"][:16])
    assert last["estimated_memory_bytes"] == doc["lm_head_bytes"] + sum(doc["layer_bytes"][16:])
    assert doc["adjacency_groups"] == [] and doc["warnings"] == []
    assert 1.0 <= doc["imbalance"] < 1.1


def test_the_model_directory_works_like_its_config_json(tmp_path: Path) -> None:
    config_file(tmp_path, LLAMA_8B_4BIT)
    by_dir = plan("--model", str(tmp_path), "--pp-size", "3", "--json")
    by_file = plan("--model", str(tmp_path / "config.json"), "--pp-size", "3", "--json")
    assert by_dir.returncode == 0 and by_dir.stdout == by_file.stdout


def test_text_preview_shows_each_stage_with_a_memory_fit_bar(tmp_path: Path) -> None:
    model = config_file(tmp_path, LLAMA_8B_4BIT)
    proc = plan("--model", str(model), "--pp-size", "2", "--stage-memory", "16GiB,1GiB")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "llama, 32 layers; 4-bit affine, group size 64" in out
    assert "plan      auto, balanced parameter bytes: 2 stage(s), --pp-layers" in out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    header, stage0, stage1 = lines[at : at + 3]
    assert header.split() == [
        "stage",
        "layers",
        "count",
        "holds",
        "estimated",
        "budget",
        "memory",
        "fit",
    ]
    assert "embedding" in stage0 and "16.0 GiB" in stage0 and "of 16.0 GiB" in stage0
    assert "lm_head" in stage1 and "1.00 GiB" in stage1 and "[" in stage1 and "]" in stage1
    # The tight stage gets fewer layers and the plan says why it is uneven.
    assert int(stage1.split()[2]) < 16
    assert "The stage memory budgets force it" in out


def test_a_manual_plan_over_budget_is_shown_with_an_over_bar(tmp_path: Path) -> None:
    model = config_file(tmp_path, LLAMA_8B_4BIT)
    proc = plan("--model", str(model), "--pp-layers", "0-29,30-31", "--stage-memory", "3GiB")
    assert proc.returncode == 0, proc.stderr
    assert "manual --pp-layers" in proc.stdout
    assert "]! " in proc.stdout and "OVER by" in proc.stdout
    assert "stage 0 needs" in proc.stdout and "it will not fit" in proc.stdout
    assert "the auto partitioner would use 0-15,16-31" in proc.stdout


def test_gemma4_e2b_groups_are_listed_and_respected(tmp_path: Path) -> None:
    model = config_file(tmp_path, GEMMA4_E2B)
    doc = json.loads(plan("--model", str(model), "--pp-size", "2", "--json").stdout)
    assert len(doc["adjacency_groups"]) == 20 and [13, 15] in doc["adjacency_groups"]
    boundary = doc["stages"][1]["layer_range"][0]
    assert not any(first < boundary <= last for first, last in doc["adjacency_groups"])
    manual = plan("--model", str(model), "--pp-layers", "0-12,13-34")
    assert manual.returncode == 0, manual.stderr
    assert "adjacency groups (source..consumer; no stage may start inside one)" in manual.stdout


def test_a_split_through_a_kv_sharing_group_is_refused(tmp_path: Path) -> None:
    model = config_file(tmp_path, GEMMA4_E2B)
    line = one_line_error(plan("--model", str(model), "--pp-layers", "0-20,21-34"))
    assert "--pp-layers: the boundary between '0-20' and '21-34' separates layer 13 from" in line


def test_budgets_that_cannot_fit_name_the_short_stage(tmp_path: Path) -> None:
    model = config_file(tmp_path, LLAMA_8B_4BIT)
    line = one_line_error(plan("--model", str(model), "--pp-size", "2", "--stage-memory", "1GiB"))
    assert "--stage-memory: the model does not fit the stage memory budgets" in line
    assert "short by" in line and "give those stages more memory" in line


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--pp-size", "2", "--stage-memory", "lots"], "'lots' is not a memory size"),
        (["--pp-size", "2", "--stage-memory", "1GiB,2GiB,3GiB"], "gives 3 sizes for 2 stages"),
        (["--pp-size", "33"], "the model has 32 layers"),
        (["--pp-size", "0"], "--pp-size 1 or more"),
        (["--pp-size", "3", "--pp-layers", "0-15,16-31"], "--pp-layers lists 2 ranges"),
        (["--pp-layers", "0-15,17-31"], "layer 16 between '0-15' and '17-31'"),
        ([], "give --pp-size N (or --pp-layers) to plan"),
        (["--pp-size", "2", "--tp-size", "3"], "does not split over 3 tensor-parallel ranks"),
        (["--pp-size", "2", "--tp-size", "0"], "0 ranks per stage; use 1 or more"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(tmp_path: Path, flags: list[str], expected: str) -> None:
    model = config_file(tmp_path, LLAMA_8B_4BIT)
    assert expected in one_line_error(plan("--model", str(model), *flags))


def test_a_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    line = one_line_error(plan("--model", str(tmp_path / "nope"), "--pp-size", "2"))
    assert "does not exist; give a model directory or its config.json" in line


def test_kimi_k3_is_previewed_with_its_refusal(tmp_path: Path) -> None:
    model = config_file(tmp_path, CASES["kimi_k3-4bit"][0])
    proc = plan("--model", str(model), "--pp-size", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    assert any(
        "kimi_k3 has no pipeline stage executor" in w for w in json.loads(proc.stdout)["warnings"]
    )


def test_help_lists_plan_and_its_flags() -> None:
    assert "plan" in mlxppctl("--help").stdout
    out = mlxppctl("plan", "--help").stdout
    for flag in ("--model", "--pp-size", "--pp-layers", "--stage-memory", "--json"):
        assert flag in out


@pytest.mark.slow
def test_default_model_is_the_embedded_one(
    embedded_model_dir: Path, cli_env: dict[str, str]
) -> None:
    proc = mlxppctl("plan", "--pp-size", "2", "--json", env=cli_env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [s["layer_range"] for s in doc["stages"]] == [[0, 15], [15, 30]]


def test_tp_size_shows_what_one_rank_of_each_stage_holds(tmp_path: Path) -> None:
    model = config_file(tmp_path, LLAMA_8B_4BIT)
    whole = json.loads(plan("--model", str(model), "--pp-size", "2", "--json").stdout)
    split = plan("--model", str(model), "--pp-size", "2", "--tp-size", "4", "--json")
    document = json.loads(split.stdout)
    assert document["tp_size"] == 4
    for stage, rank in zip(document["stages"], document["rank_bytes"], strict=True):
        first, last = stage["layer_range"]
        blocks = sum(document["layer_bytes"][first:last])
        # The blocks split over the 4 ranks; the embedding or head stays whole on each.
        assert rank == -(-blocks // 4) + stage["estimated_memory_bytes"] - blocks
    assert [s["layer_range"] for s in document["stages"]] == [
        s["layer_range"] for s in whole["stages"]
    ]
    text = plan("--model", str(model), "--pp-size", "2", "--tp-size", "4").stdout
    assert "tensor-parallel: 4 ranks per stage; each rank holds" in text
