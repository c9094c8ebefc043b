"""A 2x2 cluster (2 stages x 2 tensor-parallel ranks) under five agents, each in its own
network namespace with its own address: one TOML, every agent finds its node by its address.
Each stage's ranks join their ring on the port after their transport port (the default
``tp_address``); the chat API answers with single-process mlx-lm's text."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxppd.wire.secret import write_new_secret
from tests.support.agents import (
    CHAT,
    VENV_BIN,
    AgentProcess,
    Hosts,
    in_host_python,
    netns_unavailable,
    start_agent,
)
from tests.support.node_keys import roster_toml, write_agent_key
from tests.support.references import greedy_answers
from tests.support.tp_serving import QUESTION

pytestmark = pytest.mark.slow

_WHY = netns_unavailable()
if _WHY is not None:
    pytest.skip(f"the 2x2 agent test needs network namespaces: {_WHY}", allow_module_level=True)

HTTP_PORT = 8080


def cluster_text(addresses: list[str], secret: Path) -> str:
    lines = [
        "[cluster]", 'name = "netns-2x2"', "pipeline_parallel_size = 2",
        "tensor_parallel_size = 2", f'secret_file = "{secret}"', "",
        "[[nodes]]", 'id = "coordinator"', f'address = "{addresses[0]}:19000"', 'role = "hybrid"',
    ]  # fmt: skip
    for i, address in enumerate(addresses[1:]):
        stage, rank = divmod(i, 2)
        lines += ["", "[[nodes]]", f'id = "s{stage}-r{rank}"', f'address = "{address}:19001"']
        lines += ['role = "2d"', f"stage = {stage}", f"rank = {rank}"]
    return "\n".join(lines) + "\n" + roster_toml(HOST_NODES)


#: the node each host is (its config directory holds that node's key)
HOST_NODES = ("coordinator", "s0-r0", "s0-r1", "s1-r0", "s1-r1")


@pytest.fixture(scope="module")
def agents(
    tmp_path_factory: pytest.TempPathFactory,
    chat_llama: Path,
    model_cache: Path,
) -> Iterator[tuple[Hosts, list[AgentProcess]]]:
    root = tmp_path_factory.mktemp("agents-2x2")
    secret = root / "cluster.secret"
    write_new_secret(secret)
    hosts = Hosts.create(5)
    running: list[AgentProcess] = []
    env = {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "OPENBLAS_NUM_THREADS": "1"}
    try:
        text = cluster_text(hosts.addresses, secret)
        for i in range(5):
            config_dir = root / f"host{i}" / "etc"
            config_dir.mkdir(parents=True)
            (config_dir / "cluster.toml").write_text(text)
            write_agent_key(config_dir, HOST_NODES[i])
            (config_dir / "mlxppd.toml").write_text(
                f'model = "{chat_llama}"\nhttp_host = "0.0.0.0"\nhttp_port = {HTTP_PORT}\n'
                f'reconcile_interval_s = 2.0\nstate_dir = "{root / f"host{i}"}"\n'
            )
        # Rank 1s first: they wait in their ring for rank 0, as on hosts booting in any order.
        for i in (2, 4, 1, 3, 0):
            running.append(start_agent(hosts, i, root / f"host{i}" / "etc", env))
        running.sort(key=lambda a: a.host)
        deadline = time.monotonic() + 300
        for agent in running:
            while not any("READY" in m for m in agent.notify.messages):
                if agent.process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(agent.log()[-4000:])
                with contextlib.suppress(AssertionError):
                    agent.notify.wait_for("READY", timeout=1)
        yield hosts, running
    finally:
        for agent in running:
            agent.stop(timeout=30)
        hosts.destroy()


def test_a_2x2_cluster_under_five_agents_answers_like_mlx_lm(
    agents: tuple[Hosts, list[AgentProcess]],
    chat_llama: Path,
) -> None:
    hosts, running = agents
    expected = greedy_answers(chat_llama, [(QUESTION, 24)])[(QUESTION, 24)]
    ready = [a.notify.wait_for("READY", timeout=1)["STATUS"] for a in running]
    assert "coordinator of 2 stages" in ready[0]
    assert "stage 0 rank 0 serving layers 0-1" in ready[1]
    assert "stage 0 rank 1 following rank 0 on layers 0-1" in ready[2]
    assert "stage 1 rank 1 following rank 0 on layers 2-3" in ready[4]
    url = f"http://{hosts.addresses[0]}:{HTTP_PORT}"
    answer: dict[str, Any] = in_host_python(hosts, 0, CHAT, url, QUESTION, "24")
    assert answer["status"] == 200, answer
    assert answer["body"]["choices"][0]["message"]["content"] == expected
    done = hosts.run(
        0, str(VENV_BIN / "mlxppctl"), "status", "--json", "--config-dir",
        str(running[0].config_dir),
    )  # fmt: skip
    document = json.loads(done.stdout)
    slots = [[s["node_id"] for s in stage["slots"]] for stage in document["stages"]]
    assert slots == [["s0-r0", "s0-r1"], ["s1-r0", "s1-r1"]], document
    for index in (2, 4):  # each rank 1 joined its ring on the port after its address
        log = running[index].log()
        assert f"{hosts.addresses[index]}:19002" in log, log[-3000:]
    codes = [a.stop(timeout=60) for a in (running[0], running[1], running[3])]
    codes += [a.stop(timeout=60) for a in (running[2], running[4])]
    assert codes == [0] * 5, [a.log()[-2000:] for a in running]
