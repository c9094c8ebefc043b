"""A real admin API server for tests: ``create_app`` with the admin routes on 127.0.0.1, own
thread, over ``ScriptedCluster``.

The coordinator's runtime is stood in for by ``ScriptedCluster``, a small object implementing
the AdminController protocol, and by ``IdleBackend`` for the generation side the admin routes
never touch. Shared by tests/http/test_admin_api.py and tests/cli/test_ctl_admin.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import MISSING

from mlxppd.core.agent.elastic import ElasticState, Outcome, Trigger
from mlxppd.core.status_document import (
    ClusterStatus,
    CoordinatorStatus,
    HealthBadge,
    RepartitionEventRecord,
    RepartitionEvents,
    StageCard,
    StatusDocument,
)
from mlxppd.http.admin_api import AdminApi
from mlxppd.http.openai_api import create_app
from mlxppd.runtime.backends.contract import BackendUnavailable, Health, SamplingParams, TokenEvent
from mlxppd.wire.admin_auth import AdminVerifier, admin_key
from tests.support.http import LoopThread

SECRET = b"5d1f0c9a7e3b2d4c6a8e0f1a2b3c4d5e"
CLUSTER = "mlxpp-cluster"
API_KEY = "sk-openai-test"
MiB = 1024 * 1024


class IdleBackend:
    """A generation backend with no model: the admin routes never generate."""

    model_id = "idle-model"
    tokenizer = None

    def health(self) -> Health:
        return Health(True, "idle")

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        raise BackendUnavailable("no model here")
        yield TokenEvent(0)  # pragma: no cover - makes this an async generator


#: what a stage card says beyond what the tests set on ScriptedCluster's stages
CARD_DEFAULTS: dict[str, Any] = {
    "role": "pipeline_stage",
    "memory_budget_bytes": None,
    "parameter_bytes": None,
    "slots": (),
    "identity": None,
}


class ScriptedCluster:
    """An AdminController whose cluster state the test sets directly."""

    def __init__(self, stages: int = 2) -> None:
        self.admission = "open"
        self.in_flight = 3
        self.fail_with: Exception | None = None
        self.elastic_state = "idle"
        self.triggers: list[tuple[list[int | None] | None, str | None]] = []
        self.stages: list[dict[str, Any]] = [
            {
                "stage": i,
                "node_id": f"stage-{i}",
                "address": f"127.0.0.1:{19001 + i}",
                "layers": f"{i * 15}-{i * 15 + 14}",
                "process_alive": True,
                "transport_connected": True,
                "in_flight": 1,
                "kv_used_bytes": 64 * MiB,
                "kv_budget_bytes": 512 * MiB,
                "elastic_state": "idle",
                "config_generation": "gen-7",
                "last_reload_error": None,
                "weights": "float32",
                "blas": "OpenBLAS 0.3.21 (libopenblas.so.0, Haswell kernels, 2 threads)",
            }
            for i in range(stages)
        ]

    async def status(self) -> ClusterStatus:
        if self.fail_with is not None:
            raise self.fail_with
        coordinator = CoordinatorStatus(
            node_id="coordinator",
            http_address="127.0.0.1:8080",
            ready=True,
            detail="ready",
            admission="draining" if self.admission == "draining" else "open",
            in_flight=self.in_flight,
            waiting=0,
            transport="tcp",
            config_generation="gen-7",
            last_reload_error=None,
            elastic_state=ElasticState.IDLE,
            reload_failures=0,
            failovers=(),
            warnings=(),
            prepare=None,
        )
        stages = tuple(StageCard.model_validate(CARD_DEFAULTS | s) for s in self.stages)
        return ClusterStatus(
            cluster="mlxpp-cluster", coordinator=coordinator, stages=stages, standbys=()
        )

    async def drain(self) -> dict[str, Any]:
        self.admission = "draining"
        return {"admission": "draining", "in_flight": self.in_flight}

    async def resume(self) -> dict[str, Any]:
        self.admission = "open"
        return {"admission": "open"}

    async def repartition(
        self, stage_memory: list[int | None] | None, pp_layers: str | None
    ) -> dict[str, Any]:
        self.triggers.append((stage_memory, pp_layers))
        if self.elastic_state != "idle":
            return {"accepted": False, "reason": "busy", "message": "a repartition is running"}
        self.elastic_state = "draining"
        return {"accepted": True, "state": "draining", "seq": 0}

    async def events(self, after: int) -> RepartitionEvents:
        first = RepartitionEventRecord(
            seq=0, trigger=Trigger.EXPLICIT, from_=ElasticState.IDLE, to=ElasticState.DRAINING,
            outcome=Outcome.PROGRESS, ranges_before="0-14,15-29", ranges_after=None, at=0.0,
            phase_s=0.0, total_s=0.0, detail="",
        )  # fmt: skip
        events = tuple(e for e in (first,) if e.seq is not MISSING and e.seq > after)
        return RepartitionEvents(state=ElasticState(self.elastic_state), events=events)


def status_document(
    stages: int = 2,
    *,
    health: HealthBadge = "healthy",
    detail: str = "ok",
    coordinator: dict[str, Any] | None = None,
    cards: list[dict[str, Any]] | None = None,
    **top: Any,
) -> StatusDocument:
    """ScriptedCluster's status document with changes: ``coordinator`` and each of ``cards``
    update the coordinator and the stage cards in order, ``top`` the document's own keys."""
    raw = asyncio.run(ScriptedCluster(stages).status()).model_dump(mode="json")
    raw["coordinator"] |= coordinator or {}
    for card, change in zip(raw["stages"], cards or [], strict=False):
        card |= change
    return StatusDocument.model_validate(raw | {"health": health, "detail": detail} | top)


class AdminServer(LoopThread):
    """``create_app`` with the admin API (and an OpenAI api key) on 127.0.0.1, own thread."""

    def __init__(
        self,
        controller: ScriptedCluster,
        secret: bytes = SECRET,
        *,
        clock: Callable[[], float] = time.time,
        cluster: str = CLUSTER,
    ) -> None:
        super().__init__("admin-test-loop")
        self.controller = controller
        self.failures: list[str] = []
        verifier = AdminVerifier(admin_key(secret), cluster_name=cluster, clock=clock)
        admin = AdminApi(controller, verifier, self.failures.append)
        try:
            self.url = self.serve(create_app(IdleBackend(), api_key=API_KEY, admin=admin))
        except BaseException:
            self.stop()
            raise
        self.port = int(self.url.rsplit(":", 1)[1])

    def __enter__(self) -> AdminServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
