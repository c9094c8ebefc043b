"""Same model everywhere, under agents on three hosts (network namespaces, own model caches):
the coordinator's host holds the model; stage 0's host holds nothing; stage 1's holds a copy
whose one tensor differs in value (same shape). The coordinator refuses both and serves nothing;
``mlxppctl prepare`` ships stage 0 only its layers' tensors (interrupted half-way by killing the
coordinator, then resumed by the agent's own prepare at start without sending a byte twice) and
repairs stage 1's one tensor; the chat then equals single-process mlx-lm."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxppd.engine.stage_digest import stored_tensors
from tests.support.agents import netns_unavailable
from tests.support.prepare_cluster import (
    QUESTION,
    Cluster,
    cluster_text,
    identities,
    prepare_cluster,
    prepare_of,
)
from tests.support.prepared_copies import CHANGED, one_tensor_changed

pytestmark = pytest.mark.slow

_WHY = netns_unavailable()
if _WHY is not None:
    pytest.skip(
        f"three-host prepare tests need network namespaces: {_WHY}", allow_module_level=True
    )


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("prepare")
    name = embedded_model_dir.name
    # Host 0 holds the cluster's copy; host 1 holds nothing; host 2 a copy with one change.
    models = [
        embedded_model_dir,
        root / "host1" / "models" / name,
        root / "host2" / "models" / name,
    ]
    one_tensor_changed(embedded_model_dir, models[2])
    with prepare_cluster(root, models) as running:
        yield running


def test_a_stage_without_the_model_or_with_another_is_refused(cluster: Cluster) -> None:
    document = cluster.wait_status(lambda d: identities(d) == ["missing", "mismatch"])
    assert document["health"] == "unhealthy"
    assert "model_mismatch: stage 1 (node stage-1)" in document["detail"]
    assert "model_missing: stage 0 (node stage-0)" in document["detail"]
    wrong = document["stages"][1]["identity"]
    assert wrong["expected_sha256"] and wrong["actual_sha256"]
    assert wrong["expected_sha256"] != wrong["actual_sha256"]
    health = cluster.get("/health")
    assert health["status"] == 503 and "model_mismatch" in health["body"]["detail"]
    log = cluster.agent(0).log()
    assert "refusing model_mismatch" in log
    assert wrong["expected_sha256"][:16] in log and wrong["actual_sha256"][:16] in log
    answer = cluster.chat()  # nothing is served from the wrong weights
    assert answer["status"] == 503, answer


def test_prepare_ships_an_empty_node_its_layers_and_resumes_after_a_kill(
    cluster: Cluster, embedded_model_dir: Path
) -> None:
    # Slowed down, so the coordinator can be killed half-way through stage 0's tensors.
    ctl = subprocess.Popen(
        cluster.ctl("prepare", "--node", "stage-0", "--max-rate", "12MB"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    half = cluster.wait_status(
        lambda d: (
            prepare_of(d, "stage-0").get("bytes_sent", 0)
            > 0.3 * max(1, prepare_of(d, "stage-0").get("bytes_total", 1))
        )
    )
    cluster.agent(0).process.send_signal(signal.SIGKILL)
    cluster.agent(0).process.wait(30)
    ctl.wait(60)
    sent_before = prepare_of(half, "stage-0")["bytes_sent"]
    # The agent prepares nodes holding no copy by itself when it starts (auto_prepare).
    cluster.write_cluster(cluster_text(cluster.hosts, cluster.root / "cluster.secret", True))
    cluster.start(0)
    done = cluster.wait_status(lambda d: identities(d)[:1] == ["verified"])
    shipped = prepare_of(done, "stage-0")
    assert done["coordinator"]["prepare"]["reason"].startswith("auto")
    assert shipped["found"] == "missing" and shipped["state"] == "done"
    # Resumed: what arrived before the kill was not sent again.
    assert shipped["bytes_resumed"] >= sent_before > 0
    assert shipped["bytes_resumed"] + shipped["bytes_sent"] == shipped["bytes_total"]
    # Only stage 0's tensors: its layers and the embedding, not the whole checkpoint.
    whole = sum(
        t.record.nbytes for t in stored_tensors(embedded_model_dir, lambda _n: True).values()
    )
    assert shipped["bytes_total"] == shipped["stage_bytes"] < whole
    print(
        f"\nstage 0 received {shipped['stage_bytes'] / 1e6:.1f} MB of the model's "
        f"{whole / 1e6:.1f} MB: {shipped['bytes_resumed'] / 1e6:.1f} MB before the kill, "
        f"{shipped['bytes_sent'] / 1e6:.1f} MB after"
    )


def test_prepare_repairs_the_changed_tensor_and_the_chat_equals_mlx_lm(
    cluster: Cluster, embedded_model_dir: Path
) -> None:
    from mlx_lm import generate

    from tests.support.references import load_reference

    done = subprocess.run(cluster.ctl("prepare"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stage-1" in done.stdout and "mismatch" in done.stdout
    document = cluster.wait_status(lambda d: d["health"] == "healthy")
    assert identities(document) == ["verified", "verified"]
    repaired = prepare_of(document, "stage-1")
    changed = stored_tensors(embedded_model_dir, lambda n: n == CHANGED)[CHANGED]
    assert repaired["found"] == "mismatch" and repaired["tensors_needed"] == 1
    assert repaired["bytes_sent"] == changed.record.nbytes  # that tensor and nothing else
    assert prepare_of(document, "stage-0")["bytes_sent"] == 0  # it holds the copy already
    model, tokenizer = load_reference(embedded_model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True
    )
    answer = cluster.chat()
    assert answer["status"] == 200, answer
    assert answer["body"]["choices"][0]["message"]["content"] == generate(
        model, tokenizer, prompt, max_tokens=16
    )
