"""The admin API on the real OpenAI app: signed status/drain/resume over real HTTP on loopback.

The coordinator's runtime is stood in for by ``ScriptedCluster``, a small object implementing
the AdminController protocol, and by ``IdleBackend`` for the generation side the admin routes
never touch. ``AdminServer`` is shared with test_ctl_admin.py.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import pytest

from mlxppd.wire.admin_auth import admin_key, sign_request
from tests.support.admin_server import API_KEY, CLUSTER, SECRET, AdminServer, ScriptedCluster
from tests.support.http import request

T = TypeVar("T")


@pytest.fixture()
def server() -> Iterator[AdminServer]:
    with AdminServer(ScriptedCluster()) as live:
        yield live


def host_of(server: AdminServer) -> str:
    return server.url.split("://", 1)[1]


def signed(
    url: str,
    method: str,
    path: str,
    *,
    key: bytes = admin_key(SECRET),
    body: bytes = b"",
    header: str | None = None,
    cluster: str = CLUSTER,
    host: str | None = None,
) -> tuple[int, dict[str, str], Any]:
    """One request signed for ``cluster`` and ``host`` (default: the URL's host:port), sent
    with that Host header."""
    host = host or url.split("://", 1)[1]
    auth = header or sign(key, method, path, body, cluster=cluster, host=host)
    headers = {"Authorization": auth, "Host": host}
    return request(url, method, path, raw=body, headers=headers, timeout=30)


def sign(
    key: bytes, method: str, path: str, body: bytes = b"", *, cluster: str = CLUSTER, host: str
) -> str:
    return sign_request(key, method, path, body, now=time.time(), cluster=cluster, host=host)


def assert_refused(
    response: tuple[int, dict[str, str], Any], reason: str, cluster: str = CLUSTER
) -> None:
    status, headers, body = response
    assert status == 401, body
    assert body["error"]["type"] == "authentication_error"
    assert body["error"]["code"] == reason
    assert headers["WWW-Authenticate"] == f'MLXPP-HMAC cluster="{cluster}"'


# --- signed requests work ---


def test_signed_status_is_the_controllers_document_plus_health(server: AdminServer) -> None:
    status, headers, body = signed(server.url, "GET", "/admin/v1/status")
    assert status == 200, body
    assert body["health"] == "healthy"
    assert body["detail"] == "all 2 stages connected"
    assert body["cluster"] == "mlxpp-cluster"
    assert body["coordinator"]["admission"] == "open"
    assert [s["node_id"] for s in body["stages"]] == ["stage-0", "stage-1"]
    assert headers["Cache-Control"] == "no-store"
    assert "X-Request-Id" in headers
    assert server.failures == []


def test_drain_then_resume_change_admission_and_the_health(server: AdminServer) -> None:
    status, _, body = signed(server.url, "POST", "/admin/v1/drain")
    assert (status, body) == (200, {"admission": "draining", "in_flight": 3})
    assert server.controller.admission == "draining"
    _, _, doc = signed(server.url, "GET", "/admin/v1/status")
    assert (doc["health"], doc["detail"]) == ("degraded", "admission is draining")

    status, _, body = signed(server.url, "POST", "/admin/v1/resume")
    assert (status, body) == (200, {"admission": "open"})
    assert server.controller.admission == "open"


def test_a_lost_stage_makes_status_unhealthy(server: AdminServer) -> None:
    server.controller.stages[1].update(transport_connected=False)
    _, _, doc = signed(server.url, "GET", "/admin/v1/status")
    assert (doc["health"], doc["detail"]) == ("unhealthy", "stage 1 (stage-1) is not connected")


# --- refusals: 401, counted, logged without secrets ---


def test_an_unsigned_request_is_refused_and_counted(server: AdminServer) -> None:
    assert_refused(request(server.url, "POST", "/admin/v1/drain", timeout=30), "missing")
    assert server.controller.admission == "open"
    assert server.failures == ["missing"]


def test_a_wrong_key_is_refused_counted_and_logged_without_the_header(
    server: AdminServer, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = admin_key(b"0f1e2d3c4b5a69788796a5b4c3d2e1f0")
    header = sign(wrong, "POST", "/admin/v1/drain", host=host_of(server))
    with caplog.at_level(logging.WARNING, logger="mlxppd.http.admin"):
        assert_refused(signed(server.url, "POST", "/admin/v1/drain", header=header), "bad_mac")
    assert server.controller.admission == "open"
    assert server.failures == ["bad_mac"]
    [record] = [r for r in caplog.records if r.name == "mlxppd.http.admin"]
    line = record.getMessage()
    assert "127.0.0.1" in line and "bad_mac" in line and "/admin/v1/drain" in line
    assert header.split("mac=")[1] not in line and "nonce" not in line


def test_a_replayed_request_is_refused_and_counted(server: AdminServer) -> None:
    header = sign(admin_key(SECRET), "POST", "/admin/v1/drain", host=host_of(server))
    assert signed(server.url, "POST", "/admin/v1/drain", header=header)[0] == 200
    server.controller.admission = "open"
    assert_refused(signed(server.url, "POST", "/admin/v1/drain", header=header), "replayed")
    assert server.controller.admission == "open"
    assert server.failures == ["replayed"]


def test_a_signature_for_another_route_is_refused(server: AdminServer) -> None:
    header = sign(admin_key(SECRET), "POST", "/admin/v1/resume", host=host_of(server))
    assert_refused(signed(server.url, "POST", "/admin/v1/drain", header=header), "bad_mac")


# --- the signature is bound to the cluster and to this server's address ---


def test_a_signature_for_another_cluster_is_refused_and_the_challenge_names_this_one() -> None:
    with AdminServer(ScriptedCluster(), cluster="cluster-b") as live:
        response = signed(live.url, "POST", "/admin/v1/drain", cluster="cluster-a")
        assert_refused(response, "bad_mac", cluster="cluster-b")
        assert live.controller.admission == "open"
        assert signed(live.url, "POST", "/admin/v1/drain", cluster="cluster-b")[0] == 200


def test_a_signature_for_another_port_is_refused_as_wrong_host() -> None:
    """Two coordinators on one host with one secret and one name: a request signed for the
    first, replayed to the second with its Host intact, is refused."""
    with AdminServer(ScriptedCluster()) as first, AdminServer(ScriptedCluster()) as second:
        header = sign(admin_key(SECRET), "POST", "/admin/v1/drain", host=host_of(first))
        replay = signed(second.url, "POST", "/admin/v1/drain", header=header, host=host_of(first))
        assert_refused(replay, "wrong_host")
        assert second.controller.admission == "open"
        assert second.failures == ["wrong_host"]
        # Sent where it was signed for, the same header is accepted.
        assert signed(first.url, "POST", "/admin/v1/drain", header=header)[0] == 200


def test_a_signature_for_another_host_is_refused_as_wrong_host(server: AdminServer) -> None:
    # 192.0.2.1 (TEST-NET-1) is no address of this machine.
    other = f"192.0.2.1:{server.port}"
    assert_refused(signed(server.url, "GET", "/admin/v1/status", host=other), "wrong_host")
    assert server.failures == ["wrong_host"]


def test_a_rewritten_host_header_breaks_the_signature(server: AdminServer) -> None:
    header = sign(admin_key(SECRET), "GET", "/admin/v1/status", host=f"192.0.2.1:{server.port}")
    response = signed(server.url, "GET", "/admin/v1/status", header=header)
    assert_refused(response, "bad_mac")


def test_localhost_names_this_server_too(server: AdminServer) -> None:
    status, _, body = signed(server.url, "GET", "/admin/v1/status", host=f"localhost:{server.port}")
    assert status == 200, body


def test_the_challenge_route_is_unsigned_and_names_the_cluster() -> None:
    with AdminServer(ScriptedCluster(), cluster="lab-7") as live:
        status, headers, body = request(live.url, "GET", "/admin/v1/challenge", timeout=30)
        assert status == 200
        assert body == {"scheme": "MLXPP-HMAC", "cluster": "lab-7"}
        assert headers["Cache-Control"] == "no-store"
        assert live.failures == []


def test_a_stale_signature_is_refused() -> None:
    with AdminServer(ScriptedCluster(), clock=lambda: time.time() + 3600) as live:
        assert_refused(signed(live.url, "GET", "/admin/v1/status"), "stale")
        assert live.failures == ["stale"]


def test_an_oversize_body_is_413_before_it_is_checked(server: AdminServer) -> None:
    body = b"x" * (64 * 1024 + 1)
    status, _, error = signed(server.url, "POST", "/admin/v1/drain", body=body)
    assert status == 413, error
    assert error["error"]["code"] == "request_too_large"
    assert server.controller.admission == "open"


def test_a_signed_body_within_the_bound_is_accepted(server: AdminServer) -> None:
    status, _, _ = signed(server.url, "POST", "/admin/v1/drain", body=b"{}" * 1000)
    assert status == 200


def test_a_failing_controller_is_a_500_without_internals(server: AdminServer) -> None:
    server.controller.fail_with = RuntimeError("stage table corrupted at 0xdeadbeef")
    status, _, body = signed(server.url, "GET", "/admin/v1/status")
    assert status == 500
    assert body["error"]["code"] == "internal_error"
    assert "deadbeef" not in body["error"]["message"]


def test_the_wrong_method_is_405(server: AdminServer) -> None:
    status, _, _ = signed(server.url, "GET", "/admin/v1/drain")
    assert status == 405


# --- the OpenAI api key and the admin signature do not mix ---


def test_admin_routes_do_not_need_the_openai_api_key(server: AdminServer) -> None:
    # The fixture's app has an api key; signed admin requests above never sent it.
    status, _, _ = signed(server.url, "GET", "/admin/v1/status")
    assert status == 200


def test_the_openai_api_key_does_not_open_admin_routes(server: AdminServer) -> None:
    response = request(
        server.url,
        "POST",
        "/admin/v1/drain",
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert_refused(response, "malformed")
    assert server.controller.admission == "open"


def test_an_admin_signature_does_not_open_openai_routes(server: AdminServer) -> None:
    status, _, body = signed(server.url, "GET", "/v1/models")
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key"
    status, _, body = request(
        server.url, "GET", "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert status == 200
    assert body["data"][0]["id"] == "idle-model"


# --- elastic repartition routes ---


def test_a_repartition_trigger_carries_its_plan_and_a_second_one_is_409(
    server: AdminServer,
) -> None:
    body = json.dumps({"stage_memory": [8 << 30, None], "pp_layers": "0-9,10-29"}).encode()
    status, _, reply = signed(server.url, "POST", "/admin/v1/repartition", body=body)
    assert (status, reply["accepted"]) == (202, True)
    status, _, reply = signed(server.url, "POST", "/admin/v1/repartition", body=b"{}")
    assert (status, reply["reason"]) == (409, "busy")
    assert server.controller.triggers == [([8 << 30, None], "0-9,10-29"), (None, None)]


@pytest.mark.parametrize(
    "body",
    [b'{"stage_memry": [1]}', b'{"pp_layers": 7}', b"not json", b'{"stage_memory": [-1, "x"]}'],
)
def test_a_malformed_repartition_body_is_400(server: AdminServer, body: bytes) -> None:
    status, _, reply = signed(server.url, "POST", "/admin/v1/repartition", body=body)
    assert status == 400, reply
    assert reply["error"]["code"] == "invalid_repartition_request"
    assert server.controller.triggers == []


def test_events_after_a_sequence_number(server: AdminServer) -> None:
    status, _, reply = signed(server.url, "GET", "/admin/v1/repartition/events?after=-1")
    assert status == 200 and [e["seq"] for e in reply["events"]] == [0]
    _, _, reply = signed(server.url, "GET", "/admin/v1/repartition/events?after=0")
    assert reply["events"] == []


def test_a_repartition_trigger_needs_a_signature(server: AdminServer) -> None:
    status, _, _ = request(server.url, "POST", "/admin/v1/repartition", raw=b"{}", timeout=30)
    assert status == 401
    assert server.controller.triggers == []
