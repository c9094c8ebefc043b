"""One live 2-stage cluster (``mlxppd serve --pp-size 2``, real processes and sockets, an API
key) shared by every client-compatibility test a pytest worker runs: each test module drives
it with one real client package, as its users would.

``loopback_only`` (module scope) keeps a module's packages on this machine: no proxy, no
tracing or telemetry switched on by the environment, and any connection or name lookup beyond
loopback refused and failing the module (``loopback.py``). A failing test's report ends with
the cluster's log."""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.clients.loopback import GUARD, LoopbackGuard
from tests.support.clusters import RunningCluster, start_cluster

if TYPE_CHECKING:
    from anthropic import Anthropic
    from openai import OpenAI

#: the server's API key, and the alias it serves the embedded model under
KEY = "client-suite-key"
MODEL = "smollm"
#: lines of the cluster's log a failing test's report ends with
LOG_TAIL_LINES = 60
#: variables that would send a client through a proxy, or its traces and telemetry elsewhere
_OUTBOUND_ENV = (
    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy",
    "OPENAI_BASE_URL", "ANTHROPIC_BASE_URL", "LANGSMITH_API_KEY", "LANGCHAIN_API_KEY",
    "LOGFIRE_TOKEN", "OTEL_EXPORTER_OTLP_ENDPOINT",
)  # fmt: skip
#: and what keeps them local: tracing off; litellm's price map and tokenizers from the package
#: (read when litellm is imported: its modules import it in a fixture, under the guard)
_LOCAL_ENV = {
    "LANGSMITH_TRACING": "false",
    "LANGCHAIN_TRACING_V2": "false",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_OFFLINE_MODE": "true",
    "HF_HUB_OFFLINE": "1",
    "NO_PROXY": "127.0.0.1,localhost",
}


@dataclass(frozen=True)
class LiveCluster:
    """Where the shared cluster answers."""

    #: e.g. http://127.0.0.1:43123 (no /v1)
    url: str
    key: str
    model: str
    running: RunningCluster

    @property
    def v1(self) -> str:
        return self.url + "/v1"


@pytest.fixture(scope="session")
def live_cluster(
    tmp_path_factory: pytest.TempPathFactory, cli_env: dict[str, str]
) -> Iterator[LiveCluster]:
    tmp = tmp_path_factory.mktemp("client-cluster")
    key_file = tmp / "api.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    flags = ["--pp-size", "2", "--api-key-file", str(key_file), "--alias", MODEL]
    running = start_cluster(tmp, cli_env, *flags)
    try:
        yield LiveCluster(running.url.rstrip("/"), KEY, MODEL, running)
    finally:
        running.stop()


@pytest.fixture(scope="module")
def loopback_only() -> Iterator[LoopbackGuard]:
    """On for the whole module, its client fixtures included (imports and set-up may phone
    home too); a client module's fixtures take it first."""
    GUARD.install()
    with pytest.MonkeyPatch.context() as patch:
        for name in _OUTBOUND_ENV:
            patch.delenv(name, raising=False)
        for name, value in _LOCAL_ENV.items():
            patch.setenv(name, value)
        GUARD.refused.clear()
        GUARD.connected.clear()
        GUARD.on = True
        try:
            yield GUARD
        finally:
            GUARD.on = False
    refused, GUARD.refused = GUARD.refused, []
    assert not refused, f"a client package reached beyond loopback: {refused}"


@pytest.fixture(scope="module")
def openai_client(loopback_only: LoopbackGuard, live_cluster: LiveCluster) -> Iterator[OpenAI]:
    """The OpenAI SDK's client on the cluster's /v1 (imported here, not at collection)."""
    from openai import OpenAI

    with OpenAI(
        base_url=live_cluster.v1, api_key=live_cluster.key, max_retries=0, timeout=120
    ) as client:
        yield client


@pytest.fixture(scope="module")
def anthropic_client(
    loopback_only: LoopbackGuard, live_cluster: LiveCluster
) -> Iterator[Anthropic]:
    """The Anthropic SDK's client on the cluster (the SDK adds /v1 itself)."""
    from anthropic import Anthropic

    with Anthropic(
        base_url=live_cluster.url, api_key=live_cluster.key, max_retries=0, timeout=120
    ) as client:
        yield client


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    # The shared cluster, or a module's own (anything holding a RunningCluster as .running).
    for value in getattr(item, "funcargs", {}).values():
        running = getattr(value, "running", None)
        if report.failed and isinstance(running, RunningCluster):
            tail = running.log().splitlines()[-LOG_TAIL_LINES:]
            report.sections.append(("live cluster log (last lines)", "\n".join(tail)))
            break
    return report


@pytest.fixture(scope="session")
def cli_env(model_cache: Path) -> dict[str, str]:
    """The session-wide environment of the shared cluster (tests/conftest.py's is per test)."""
    env = dict(os.environ)
    env["MLXPP_MODEL_CACHE"] = str(model_cache)
    env["HF_HUB_OFFLINE"] = "1"
    return env
