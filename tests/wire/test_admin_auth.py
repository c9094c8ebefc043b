"""Signed admin requests: the key derivation, the header format, the cluster and Host binding,
and every refusal reason."""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxppd.wire.admin_auth import (
    AUTH_REASONS,
    MAX_HEADER_CHARS,
    AdminAuthError,
    AdminVerifier,
    admin_key,
    challenge,
    challenged_cluster,
    host_names_this_server,
    sign_request,
)

SECRET = b"0123456789abcdef0123456789abcdef"
KEY = admin_key(SECRET)
NOW = 1_700_000_000.0
PATH = "/admin/v1/status"
CLUSTER = "cluster-a"
HOST = "10.0.0.1:8080"


def sign(
    key: bytes,
    method: str,
    path: str,
    body: bytes,
    *,
    now: float,
    nonce: str | None = None,
    cluster: str = CLUSTER,
    host: str = HOST,
) -> str:
    return sign_request(key, method, path, body, now=now, nonce=nonce, cluster=cluster, host=host)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def verifier(clock: Clock | None = None, cluster: str = CLUSTER, **options: Any) -> AdminVerifier:
    return AdminVerifier(KEY, cluster_name=cluster, clock=clock or Clock(), **options)


def refusal(
    v: AdminVerifier, header: str | None, method: str, path: str, body: bytes, host: str = HOST
) -> str:
    with pytest.raises(AdminAuthError) as info:
        v.verify(header, method, path, body, host=host)
    assert str(info.value) == f"admin request refused: {info.value.reason}"
    return info.value.reason


# --- the key and the header ---


def test_the_key_is_hkdf_sha256_of_the_secret_and_never_the_secret() -> None:
    assert len(KEY) == 32
    assert KEY != SECRET[:32]
    assert admin_key(SECRET) == KEY
    assert admin_key(SECRET + b"x") != KEY


def test_the_header_carries_timestamp_nonce_and_an_hmac_of_the_documented_string() -> None:
    body = b'{"x": 1}'
    header = sign(
        KEY, "post", "/admin/v1/drain", body, now=NOW + 0.9, nonce="ab" * 16, host="Coord.LAN:8080"
    )
    match = re.fullmatch(r"MLXPP-HMAC ts=(\d+),nonce=([0-9a-f]{32}),mac=([0-9a-f]{64})", header)
    assert match is not None
    assert match[1] == str(int(NOW))
    assert match[2] == "ab" * 16
    lines = [
        "POST",
        "/admin/v1/drain",
        str(int(NOW)),
        "ab" * 16,
        hashlib.sha256(body).hexdigest(),
        CLUSTER,
        "coord.lan:8080",  # the Host header, lower-cased
    ]
    assert match[3] == hmac.new(KEY, "\n".join(lines).encode(), "sha256").hexdigest()


def test_every_signature_gets_a_fresh_random_nonce() -> None:
    headers = {sign(KEY, "GET", PATH, b"", now=NOW) for _ in range(20)}
    assert len(headers) == 20


def test_a_caller_chosen_nonce_must_be_32_hex_digits() -> None:
    with pytest.raises(ValueError):
        sign(KEY, "GET", PATH, b"", now=NOW, nonce="short")


def test_the_verifier_repr_does_not_show_the_key() -> None:
    assert KEY.hex() not in repr(verifier())
    assert "redacted" in repr(verifier())


# --- acceptance ---


def test_a_signed_request_verifies() -> None:
    v = verifier()
    v.verify(
        sign(KEY, "POST", "/admin/v1/drain", b"{}", now=NOW),
        "POST",
        "/admin/v1/drain",
        b"{}",
        host=HOST,
    )
    v.verify(sign(KEY, "GET", PATH, b"", now=NOW), "GET", PATH, b"", host=HOST)


def test_clock_skew_inside_the_window_is_accepted_both_ways() -> None:
    v = verifier(Clock(NOW), window_s=60)
    v.verify(sign(KEY, "GET", PATH, b"", now=NOW - 60), "GET", PATH, b"", host=HOST)
    v.verify(sign(KEY, "GET", PATH, b"", now=NOW + 60), "GET", PATH, b"", host=HOST)


# --- the cluster and Host binding ---


def test_a_signature_for_cluster_a_is_refused_by_cluster_b() -> None:
    header = sign(KEY, "POST", "/admin/v1/drain", b"", now=NOW, cluster="cluster-a")
    assert refusal(verifier(cluster="cluster-b"), header, "POST", "/admin/v1/drain", b"") == (
        "bad_mac"
    )
    verifier(cluster="cluster-a").verify(header, "POST", "/admin/v1/drain", b"", host=HOST)


def test_a_signature_for_host_x_is_refused_with_host_y() -> None:
    header = sign(KEY, "POST", "/admin/v1/drain", b"", now=NOW, host="10.0.0.1:8080")
    for other in ("10.0.0.2:8080", "10.0.0.1:8081", "10.0.0.1", ""):
        assert refusal(verifier(), header, "POST", "/admin/v1/drain", b"", host=other) == "bad_mac"
    # Host names are case-insensitive, so only the case may differ.
    verifier().verify(header, "POST", "/admin/v1/drain", b"", host="10.0.0.1:8080".upper())


def test_the_cluster_name_may_follow_a_reload() -> None:
    names = ["cluster-a"]
    v = AdminVerifier(KEY, cluster_name=lambda: names[0], clock=Clock())
    assert v.cluster_name == "cluster-a"
    v.verify(sign(KEY, "GET", PATH, b"", now=NOW), "GET", PATH, b"", host=HOST)
    names[0] = "renamed"
    assert refusal(v, sign(KEY, "GET", PATH, b"", now=NOW), "GET", PATH, b"") == "bad_mac"
    header = sign(KEY, "GET", PATH, b"", now=NOW, cluster="renamed")
    v.verify(header, "GET", PATH, b"", host=HOST)


def test_the_challenge_names_the_cluster_to_sign_for() -> None:
    assert challenge("lab-1") == 'MLXPP-HMAC cluster="lab-1"'
    assert challenged_cluster(challenge("lab-1")) == "lab-1"
    assert challenged_cluster(challenge("")) == ""
    for header in (None, "", "MLXPP-HMAC", 'MLXPP-HMAC cluster="a b"', 'Bearer cluster="x"'):
        assert challenged_cluster(header) is None


MINE = {"10.0.0.1", "coord.lan", "localhost", "::1"}


@pytest.mark.parametrize(
    ("host", "port", "names_it"),
    [
        ("10.0.0.1:8080", 8080, True),
        ("COORD.lan:8080", 8080, True),
        ("[::1]:8080", 8080, True),
        ("coord.lan", 80, True),  # no port: the default port
        ("10.0.0.2:8080", 8080, False),  # another host: a replay
        ("10.0.0.1:8081", 8080, False),  # another port on this host: another coordinator
        ("coord.lan", 8080, False),
        ("[::1", 8080, False),
        (":8080", 8080, False),
        ("", 8080, False),
    ],
)
def test_a_host_header_names_this_server_by_its_address_and_port(
    host: str, port: int, names_it: bool
) -> None:
    assert host_names_this_server(host, port, MINE.__contains__) is names_it


# --- refusals ---


def test_no_header_is_missing() -> None:
    assert refusal(verifier(), None, "GET", PATH, b"") == "missing"
    assert refusal(verifier(), "", "GET", PATH, b"") == "missing"


def test_a_different_key_is_bad_mac() -> None:
    other = admin_key(b"another cluster's secret, 32 b..")
    header = sign(other, "GET", PATH, b"", now=NOW)
    assert refusal(verifier(), header, "GET", PATH, b"") == "bad_mac"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", PATH, b""),  # method changed from POST
        ("POST", "/admin/v1/resume", b"{}"),  # path changed
        ("POST", "/admin/v1/drain?x=1", b"{}"),  # query added
        ("POST", "/admin/v1/drain", b"{ }"),  # body changed
    ],
)
def test_an_altered_method_path_or_body_is_bad_mac(method: str, path: str, body: bytes) -> None:
    header = sign(KEY, "POST", "/admin/v1/drain", b"{}", now=NOW)
    assert refusal(verifier(), header, method, path, body) == "bad_mac"


@pytest.mark.parametrize("skew", [-61, 61, -10_000, 10**9])
def test_a_timestamp_outside_the_window_is_stale(skew: float) -> None:
    header = sign(KEY, "GET", PATH, b"", now=NOW + skew)
    assert refusal(verifier(window_s=60), header, "GET", PATH, b"") == "stale"


def test_the_same_request_twice_is_replayed() -> None:
    v = verifier()
    header = sign(KEY, "POST", "/admin/v1/drain", b"", now=NOW)
    v.verify(header, "POST", "/admin/v1/drain", b"", host=HOST)
    assert refusal(v, header, "POST", "/admin/v1/drain", b"") == "replayed"


def test_a_replay_after_the_window_is_stale_and_the_nonce_is_forgotten() -> None:
    clock = Clock()
    v = verifier(clock, window_s=60)
    header = sign(KEY, "GET", PATH, b"", now=NOW)
    v.verify(header, "GET", PATH, b"", host=HOST)
    clock.now = NOW + 61
    assert refusal(v, header, "GET", PATH, b"") == "stale"
    v.verify(sign(KEY, "GET", PATH, b"", now=clock.now), "GET", PATH, b"", host=HOST)
    assert v.remembered == 1


def test_a_forged_request_is_not_remembered() -> None:
    v = verifier()
    forged = sign(admin_key(b"x" * 32), "GET", PATH, b"", now=NOW, nonce="cd" * 16)
    refusal(v, forged, "GET", PATH, b"")
    assert v.remembered == 0
    # The genuine holder of the nonce is not locked out by the forgery.
    v.verify(sign(KEY, "GET", PATH, b"", now=NOW, nonce="cd" * 16), "GET", PATH, b"", host=HOST)


def test_nonce_memory_is_bounded_without_reopening_a_replay() -> None:
    clock = Clock()
    v = verifier(clock, max_nonces=3)
    headers = []
    for i in range(5):
        clock.now = NOW + i
        header = sign(KEY, "GET", PATH, b"", now=clock.now)
        v.verify(header, "GET", PATH, b"", host=HOST)
        headers.append(header)
        assert v.remembered <= 3
    # The two oldest were forgotten; their timestamps are refused from now on.
    for header in headers[:2]:
        assert refusal(v, header, "GET", PATH, b"") == "stale"
    for header in headers[2:]:
        assert refusal(v, header, "GET", PATH, b"") == "replayed"
    v.verify(sign(KEY, "GET", PATH, b"", now=clock.now), "GET", PATH, b"", host=HOST)


GOOD = sign(KEY, "GET", PATH, b"", now=NOW, nonce="ef" * 16)


@pytest.mark.parametrize(
    "header",
    [
        "Bearer sk-123",
        "MLXPP-HMAC",
        "MLXPP-HMAC ",
        "mlxpp-hmac " + GOOD.split(" ", 1)[1],  # the scheme is case-sensitive
        GOOD.replace("ts=", "time="),
        GOOD + ",extra=1",
        GOOD + ",ts=1",  # a duplicate field
        GOOD.replace(",mac=", ",mac=" + "0"),  # 65 hex digits
        GOOD.replace("nonce=" + "ef" * 16, "nonce=" + "EF" * 16),
        GOOD.replace(f"ts={int(NOW)}", "ts=-5"),
        GOOD.replace(f"ts={int(NOW)}", "ts=1e9"),
        GOOD.replace(",", ", "),
        GOOD.replace(" ", "  ", 1),
    ],
)
def test_a_malformed_header_is_malformed(header: str) -> None:
    assert refusal(verifier(), header, "GET", PATH, b"") == "malformed"


def test_an_oversize_header_is_refused_before_parsing() -> None:
    header = GOOD + "," + "x" * MAX_HEADER_CHARS
    assert refusal(verifier(), header, "GET", PATH, b"") == "malformed"


@given(st.text(max_size=2 * MAX_HEADER_CHARS))
def test_any_header_string_is_accepted_or_refused_with_a_reason(header: str) -> None:
    try:
        verifier().verify(header, "GET", PATH, b"", host=HOST)
    except AdminAuthError as exc:
        assert exc.reason in AUTH_REASONS


@given(
    st.dictionaries(
        st.sampled_from(["ts", "nonce", "mac", "x"]),
        st.text(alphabet="0123456789abcdefABCDEF-=, ", max_size=70),
        max_size=4,
    )
)
def test_near_miss_headers_are_refused_with_a_reason(fields: dict[str, str]) -> None:
    header = "MLXPP-HMAC " + ",".join(f"{k}={v}" for k, v in fields.items())
    with pytest.raises(AdminAuthError) as info:
        verifier().verify(header, "GET", PATH, b"", host=HOST)
    assert info.value.reason in AUTH_REASONS
