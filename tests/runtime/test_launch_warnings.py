"""Pre-launch warnings (mlxppd/core/partition/launch.py, docs/partitioning.md)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from mlxppd.core.config.cluster import ClusterConfig, parse_cluster_config
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.partition.launch import (
    BEST_TESTED_FAMILIES,
    cluster_partition_plan,
    launch_warnings,
)
from mlxppd.core.partition.plan import PartitionPlan, balance_layers, plan_layers
from mlxppd.core.profile.model import profile_from_config
from mlxppd.runtime.local_cluster import free_port
from mlxppd.wire.secret import write_new_secret
from tests.support.synthetic_profiles import synthetic


def _plan(stages: int, model_type: str = "llama") -> PartitionPlan:
    profile = replace(synthetic([10] * 12), model_type=model_type, family=model_type)
    return balance_layers(profile, stages)


def test_three_stages_over_tcp_warn() -> None:
    warnings = launch_warnings(_plan(3), "tcp", "llama")
    assert len(warnings) == 1
    assert warnings[0].startswith("3 stages over TCP")
    assert "each extra TCP hop adds latency" in warnings[0]
    assert "thunderbolt or rdma" in warnings[0]


def test_two_stages_over_tcp_do_not() -> None:
    assert launch_warnings(_plan(2), "tcp", "llama") == ()


def test_three_stages_over_a_fast_link_do_not() -> None:
    assert launch_warnings(_plan(3), "thunderbolt", "llama") == ()
    assert launch_warnings(_plan(3), "rdma", "llama") == ()


def test_a_family_outside_the_best_tested_set_warns() -> None:
    (warning,) = launch_warnings(_plan(2), "tcp", "gemma4_text")
    assert "'gemma4_text'" in warning
    assert "small random-weight fixtures only" in warning


def test_the_best_tested_families_do_not_warn() -> None:
    assert BEST_TESTED_FAMILIES == {"llama", "mistral", "qwen3"}
    for family in BEST_TESTED_FAMILIES:
        assert launch_warnings(_plan(2), "tcp", family) == ()


def test_the_family_defaults_to_the_plan_profile() -> None:
    assert launch_warnings(_plan(2, "llama"), "tcp") == ()
    (warning,) = launch_warnings(_plan(2, "jamba"), "tcp")
    assert "'jamba'" in warning


def test_an_over_budget_plan_carries_the_plan_warning() -> None:
    profile = synthetic([10] * 4)
    plan = plan_layers(profile, [LayerRange(0, 3), LayerRange(3, 4)], [20, None])
    over = [w for w in plan.warnings if "it will not fit" in w]
    assert over
    warnings = launch_warnings(plan, "tcp", "llama")
    assert warnings[: len(plan.warnings)] == plan.warnings
    assert over[0] in warnings


def _cluster(layers: str = "", transport: str = "tcp") -> ClusterConfig:
    text = f'[cluster]\npipeline_parallel_size = 3\ntransport_backend = "{transport}"\n{layers}\n'
    text += '[[nodes]]\nid = "coordinator"\naddress = "10.0.0.1:19000"\nrole = "hybrid"\n'
    for i in range(3):
        text += (
            f'[[nodes]]\nid = "s{i}"\naddress = "10.0.0.{i + 2}:19001"\n'
            f'role = "pipeline_stage"\nstage = {i}\n'
        )
    return parse_cluster_config(text, "cluster.toml")


LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 6,
    "vocab_size": 256,
}

LLAMA = profile_from_config(LLAMA_CONFIG)


def test_a_cluster_plan_names_its_stage_nodes() -> None:
    cluster = _cluster()
    ranges = (LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 6))
    plan = cluster_partition_plan(cluster, LLAMA, ranges)
    assert [s.device_id for s in plan.stages] == ["s0", "s1", "s2"]
    assert plan.ranges == ranges and plan.auto
    manual = cluster_partition_plan(_cluster('layers = ["0-1", "2-3", "4-5"]'), LLAMA)
    assert manual.ranges == ranges and not manual.auto


def test_a_cluster_plan_without_ranges_is_the_balancers() -> None:
    plan = cluster_partition_plan(_cluster(), LLAMA)
    assert plan.auto and len(plan.stages) == 3
    (warning,) = launch_warnings(plan, _cluster().cluster.transport_backend)
    assert warning.startswith("3 stages over TCP")


# -- where the operator sees them: a live 3-stage cluster of a non-llama family ---------------


@pytest.mark.slow
def test_three_stages_of_mixtral_warn_in_the_log_the_status_and_the_dry_run(
    tmp_path: Path, cli_env: dict[str, str], tiny_model: Any, embedded_model_dir: Path
) -> None:
    from tests.support.clusters import start_cluster
    from tests.support.family_cases import CASES

    model = tmp_path / "mixtral"
    shutil.copytree(tiny_model("warn-mixtral", CASES["mixtral"][0]), model)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(embedded_model_dir / name, model / name)  # the coordinator tokenizes
    secret = tmp_path / "cluster.secret"
    write_new_secret(secret)
    expected = ("3 stages over TCP", "model family 'mixtral' is outside the best-tested set")
    running = start_cluster(
        tmp_path, cli_env, "--pp-size", "3", "--model", str(model), "--no-warmup",
        "--cluster-secret-file", str(secret),
    )  # fmt: skip
    try:
        log = running.log()
        for warning in expected:
            assert f"WARNING partition warning: {warning}" in log, log[-3000:]
        status = subprocess.run(
            [sys.executable, "-m", "mlxppd.cli.mlxppctl_main", "status", "--json",
             "--url", running.url, "--cluster-secret-file", str(secret)],
            capture_output=True, text=True, env=cli_env, timeout=120,
        )  # fmt: skip
        warnings = json.loads(status.stdout)["coordinator"]["warnings"]
        for warning in expected:
            assert any(w.startswith(warning) for w in warnings), warnings
    finally:
        assert running.stop() == 0, running.log()[-3000:]
    # Free ports, not fixed ones: the other test workers' clusters listen on loopback too.
    peers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(3))
    dry = subprocess.run(
        [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", "--pp-auto", "3", "--dry-run",
         "--model", str(model), "--cluster-peers", peers, "--cluster-secret-file", str(secret),
         "--cluster-control-addr", f"127.0.0.1:{free_port()}", "--cluster-config-out",
         str(tmp_path / "planned.toml")],
        capture_output=True, text=True, env=cli_env, timeout=120,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    for warning in expected:
        assert f"partition warning: {warning}" in dry.stdout, dry.stdout
