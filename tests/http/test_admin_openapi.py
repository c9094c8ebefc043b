"""The admin API's OpenAPI document and the status document's model: the document is checked in
and current, valid OpenAPI 3.1, served unsigned at /admin/v1/openapi.json and covers every
admin route; and a live 2-stage cluster's answers (status before and after a repartition,
events, drain, resume, a refused prepare, the challenge) parse into the models, dump back to
the very same JSON, and validate against the document's schemas."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp import web
from jsonschema import Draft202012Validator
from pydantic import MISSING, BaseModel

from mlxppd.core.status_document import RepartitionEvents, StatusDocument
from mlxppd.http import admin_models as m
from mlxppd.http.admin_api import add_admin_routes
from mlxppd.http.admin_openapi import admin_openapi_document, admin_openapi_text
from mlxppd.wire.admin_auth import AdminVerifier, admin_key, sign_request
from mlxppd.wire.secret import write_new_secret
from tests.support.admin_server import CLUSTER, SECRET, AdminServer, ScriptedCluster
from tests.support.clusters import RunningCluster, start_cluster
from tests.support.http import request
from tests.support.paths import REPO_ROOT

CHECKED_IN = REPO_ROOT / "docs" / "admin-openapi.json"
DOC = admin_openapi_document()
LOCAL_CLUSTER = "mlxpp-local"
M = TypeVar("M", bound=BaseModel)


def conforms(model: type[M], body: Any) -> M:
    """``body`` parses as a ``model``, dumps back to itself, and is valid against the
    document's schema of the same name."""
    parsed = model.model_validate(body)
    assert parsed.model_dump(mode="json") == body
    schema = {"$ref": f"#/components/schemas/{model.__name__}", "components": DOC["components"]}
    errors = sorted(Draft202012Validator(schema).iter_errors(body), key=str)
    assert not errors, f"{model.__name__}: {errors[0].message} at {list(errors[0].path)}"
    return parsed


# --- the document itself ---


def test_the_checked_in_document_is_current_and_the_script_checks_it() -> None:
    assert CHECKED_IN.read_text(encoding="utf-8") == admin_openapi_text(), (
        "docs/admin-openapi.json is stale; run: python scripts/gen_openapi.py"
    )
    spec = importlib.util.spec_from_file_location("gen", REPO_ROOT / "scripts/gen_openapi.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--check"]) == 0


def test_the_document_is_valid_openapi_3_1_and_deterministic() -> None:
    from openapi_spec_validator import OpenAPIV31SpecValidator, validate

    validate(DOC, cls=OpenAPIV31SpecValidator)
    assert admin_openapi_document() == DOC
    assert json.loads(admin_openapi_text()) == DOC
    parts = {
        "StatusDocument", "StageCard", "NodeCard", "CoordinatorStatus", "SlotStatus",
        "FailoverRecord", "PrepareStatus", "PrepareNodeProgress", "RepartitionEvents",
    }  # fmt: skip
    assert parts <= set(DOC["components"]["schemas"])


def test_every_field_of_the_status_document_says_what_it_is() -> None:
    """The project's style: each field has a one-line description (its units with it)."""
    schemas = DOC["components"]["schemas"]
    missing = [
        f"{name}.{field}"
        for name, schema in schemas.items()
        if name not in ("ErrorResponse", "ErrorDetail", "LayerLoad")  # the /v1 API's; a stage's
        for field, prop in schema.get("properties", {}).items()
        if not prop.get("description")
    ]
    assert missing == []


def test_it_is_served_unsigned_and_documents_every_admin_route() -> None:
    with AdminServer(ScriptedCluster()) as live:
        status, headers, body = request(live.url, "GET", m.ADMIN_OPENAPI_PATH, timeout=30)
        assert status == 200 and headers["Content-Type"].startswith("application/json")
        assert body == DOC
    app = web.Application()
    verifier = AdminVerifier(admin_key(SECRET), cluster_name=CLUSTER, clock=time.time)
    add_admin_routes(app, ScriptedCluster(), verifier)
    routes = {
        (r.method.lower(), r.resource.canonical)
        for r in app.router.routes()
        if r.method != "HEAD" and r.resource is not None
        and r.resource.canonical.startswith(m.ADMIN_PREFIX)
    }  # fmt: skip
    documented = {(method, path) for path, item in DOC["paths"].items() for method in item}
    assert routes == documented


def test_the_scripted_status_is_a_status_document() -> None:
    with AdminServer(ScriptedCluster()) as live:
        body = signed(live.url, "GET", m.STATUS_PATH, admin_key(SECRET), CLUSTER)
    conforms(StatusDocument, body)


# --- a live cluster ---


def signed(url: str, method: str, path: str, key: bytes, cluster: str, body: bytes = b"") -> Any:
    host = url.split("://", 1)[1]
    auth = sign_request(key, method, path, body, now=time.time(), cluster=cluster, host=host)
    headers = {"Authorization": auth, "Host": host}
    status, _, answer = request(url, method, path, raw=body, headers=headers, timeout=60)
    assert status in (200, 202, 409), (status, answer)
    return answer


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path
) -> Iterator[tuple[RunningCluster, bytes]]:
    root = tmp_path_factory.mktemp("admin-openapi")
    secret = root / "cluster.secret"
    write_new_secret(secret)
    env = {**os.environ, "MLXPP_MODEL_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}
    flags = ("--pp-size", "2", "--enable-elastic-pp", "--cluster-secret-file", str(secret))
    running = start_cluster(root, env, *flags)
    try:
        yield running, admin_key(secret.read_bytes().strip())
    finally:
        assert running.stop() == 0, running.log()[-3000:]


@pytest.mark.slow
def test_a_live_clusters_answers_are_the_models(cluster: tuple[RunningCluster, bytes]) -> None:
    running, key = cluster
    url = running.url

    def ask(method: str, path: str, body: bytes = b"") -> Any:
        return signed(url, method, path, key, LOCAL_CLUSTER, body)

    before = conforms(StatusDocument, ask("GET", m.STATUS_PATH))
    assert before.health == "healthy" and len(before.stages) == 2
    assert before.coordinator.elastic_enabled is True
    assert before.coordinator.last_repartition_event is None
    status, _, challenge = request(url, "GET", m.CHALLENGE_PATH, timeout=30)
    assert status == 200
    conforms(m.Challenge, challenge)
    conforms(m.AdmissionReply, ask("POST", m.DRAIN_PATH))
    assert conforms(StatusDocument, ask("GET", m.STATUS_PATH)).health == "degraded"
    conforms(m.AdmissionReply, ask("POST", m.RESUME_PATH))
    # `mlxppd serve` ships no model: the prepare is refused, in the Refusal shape.
    conforms(m.Refusal, ask("POST", m.PREPARE_PATH, b"{}"))

    accepted = conforms(
        m.RepartitionAccepted, ask("POST", m.REPARTITION_PATH, b'{"pp_layers": "0-9,10-29"}')
    )
    seq = accepted.seq
    deadline = time.monotonic() + 300
    while True:
        page = conforms(RepartitionEvents, ask("GET", f"{m.EVENTS_PATH}?after={seq - 1}"))
        if page.state == "idle" and len(page.events) > 1:
            break
        assert time.monotonic() < deadline, page
        time.sleep(0.5)
    after = conforms(StatusDocument, ask("GET", m.STATUS_PATH))
    assert [c.layers for c in after.stages] == ["0-9", "10-29"]
    event = after.coordinator.last_repartition_event
    assert event is not MISSING and event is not None and event.outcome == "completed"
    assert after.coordinator.last_repartition_loads  # what each stage read


def test_the_example_in_the_admin_docs_is_a_status_document() -> None:
    text = (REPO_ROOT / "docs" / "admin-api.md").read_text(encoding="utf-8")
    section = text.split("## The status document", 1)[1]
    example = section.split("```json\n", 1)[1].split("```", 1)[0]
    StatusDocument.model_validate_json(example)
