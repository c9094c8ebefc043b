"""Same model everywhere, under agents on three hosts (network namespaces, own model caches):
the coordinator's host holds the model; stage 0's host holds nothing; stage 1's holds a copy
whose one tensor differs in value (same shape). The coordinator refuses both and serves nothing;
``mlxppctl prepare`` ships stage 0 only its layers' tensors (interrupted half-way by killing the
coordinator, then resumed by the agent's own prepare at start without sending a byte twice) and
repairs stage 1's one tensor; the chat then equals single-process mlx-lm."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxppd.engine.stage_digest import stored_tensors
from tests.support.agents import (
    CHAT,
    VENV_BIN,
    AgentProcess,
    Hosts,
    in_host_python,
    netns_unavailable,
    node_tables,
    start_agent,
    wait_for_status,
)

pytestmark = pytest.mark.slow

_WHY = netns_unavailable()
if _WHY is not None:
    pytest.skip(
        f"three-host prepare tests need network namespaces: {_WHY}", allow_module_level=True
    )

QUESTION = "What is the capital of France?"
HTTP_PORT = 8080
CHANGED = "model.layers.20.mlp.down_proj.scales"  # stage 1's layers (15-29)


def cluster_text(hosts: Hosts, secret: Path, auto_prepare: bool) -> str:
    a0, a1, a2 = hosts.addresses
    head = (
        f'[cluster]\nname = "prepare-test"\npipeline_parallel_size = 2\n'
        f'secret_file = "{secret}"\nauto_prepare = {str(auto_prepare).lower()}\n\n'
    )
    return head + node_tables(f"{a0}:19000", f"{a1}:19001", f"{a2}:19001")


def one_tensor_changed(source: Path, target: Path) -> None:
    import mlx.core as mx

    shutil.copytree(source, target)
    weights = mx.load(str(target / "model.safetensors"))
    assert isinstance(weights, dict)
    weights[CHANGED] = weights[CHANGED] * 1.5
    mx.save_safetensors(str(target / "model.safetensors"), weights, {"format": "mlx"})


class Cluster:
    def __init__(self, hosts: Hosts, root: Path, env: list[dict[str, str]]) -> None:
        self.hosts, self.root, self.env = hosts, root, env
        self.agents: list[AgentProcess] = []
        self.url = f"http://{hosts.addresses[0]}:{HTTP_PORT}"

    def config_dir(self, i: int) -> Path:
        return self.root / f"host{i}" / "etc"

    def start(self, i: int) -> AgentProcess:
        agent = start_agent(self.hosts, i, self.config_dir(i), self.env[i])
        self.agents = [a for a in self.agents if a.host != i] + [agent]
        return agent

    def agent(self, i: int) -> AgentProcess:
        return next(a for a in self.agents if a.host == i)

    def write_cluster(self, text: str) -> None:
        for i in range(3):
            tmp = self.config_dir(i) / "cluster.toml.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.config_dir(i) / "cluster.toml")

    def ctl(self, *args: str) -> list[str]:
        return [
            "ip", "netns", "exec", self.hosts.names[0], str(VENV_BIN / "mlxppctl"), *args,
            "--config-dir", str(self.config_dir(0)),
        ]  # fmt: skip

    def status(self) -> dict[str, Any]:
        done = subprocess.run(self.ctl("status", "--json"), capture_output=True, text=True)
        assert done.returncode in (0, 1, 3), done.stderr
        if done.returncode == 3:  # the coordinator's agent is (re)starting
            return {}
        document: dict[str, Any] = json.loads(done.stdout)
        return document

    def wait_status(self, predicate: Any, timeout: float = 180) -> dict[str, Any]:
        def logs() -> str:
            return "\n".join(a.log()[-3000:] for a in self.agents)

        return wait_for_status(self.status, lambda d: bool(d) and predicate(d), timeout, logs)

    def get(self, path: str) -> dict[str, Any]:
        code = (
            "import json, sys, httpx\nr = httpx.get(sys.argv[1], timeout=30)\n"
            "print(json.dumps({'status': r.status_code, 'body': r.json()}))"
        )
        result: dict[str, Any] = in_host_python(self.hosts, 0, code, self.url + path)
        return result

    def chat(self) -> dict[str, Any]:
        result: dict[str, Any] = in_host_python(self.hosts, 0, CHAT, self.url, QUESTION, "16")
        return result


def identities(document: dict[str, Any]) -> list[str | None]:
    return [(s.get("identity") or {}).get("state") for s in document.get("stages", [])]


def prepare_of(document: dict[str, Any], node: str) -> dict[str, Any]:
    job = document["coordinator"].get("prepare") or {}
    return next((n for n in job.get("nodes", []) if n["node"] == node), {})


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("prepare")
    secret = root / "cluster.secret"
    secret.write_text("prepare-test-secret-0123456789abcdef\n")
    secret.chmod(0o600)
    name = embedded_model_dir.name
    # Host 0 holds the cluster's copy; host 1 holds nothing; host 2 a copy with one change.
    models = [
        embedded_model_dir,
        root / "host1" / "models" / name,
        root / "host2" / "models" / name,
    ]
    one_tensor_changed(embedded_model_dir, models[2])
    hosts = Hosts.create(3)
    env = [
        {**os.environ, "MLXPP_MODEL_CACHE": str(root / f"host{i}" / "cache"), "HF_HUB_OFFLINE": "1"}
        for i in range(3)
    ]
    running = Cluster(hosts, root, env)
    try:
        text = cluster_text(hosts, secret, auto_prepare=False)
        for i in range(3):
            config_dir = running.config_dir(i)
            config_dir.mkdir(parents=True)
            (config_dir / "cluster.toml").write_text(text)
            (config_dir / "mlxppd.toml").write_text(
                f'model = "{models[i]}"\nhttp_host = "0.0.0.0"\nhttp_port = {HTTP_PORT}\n'
                f'reconcile_interval_s = 2.0\nstate_dir = "{root / f"host{i}"}"\n'
            )
        for i in (1, 2, 0):
            running.start(i)
        yield running
    finally:
        for agent in running.agents:
            agent.stop(timeout=30)
        hosts.destroy()


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
