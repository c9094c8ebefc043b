"""Signed admin requests: the key derivation, the header format, and every refusal reason."""

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
    sign_request,
)

SECRET = b"0123456789abcdef0123456789abcdef"
KEY = admin_key(SECRET)
NOW = 1_700_000_000.0
PATH = "/admin/v1/status"


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def verifier(clock: Clock | None = None, **options: Any) -> AdminVerifier:
    return AdminVerifier(KEY, clock=clock or Clock(), **options)


def refusal(v: AdminVerifier, header: str | None, method: str, path: str, body: bytes) -> str:
    with pytest.raises(AdminAuthError) as info:
        v.verify(header, method, path, body)
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
    header = sign_request(KEY, "post", "/admin/v1/drain", body, now=NOW + 0.9, nonce="ab" * 16)
    match = re.fullmatch(r"MLXPP-HMAC ts=(\d+),nonce=([0-9a-f]{32}),mac=([0-9a-f]{64})", header)
    assert match is not None
    assert match[1] == str(int(NOW))
    assert match[2] == "ab" * 16
    message = f"POST\n/admin/v1/drain\n{int(NOW)}\n{'ab' * 16}\n{hashlib.sha256(body).hexdigest()}"
    assert match[3] == hmac.new(KEY, message.encode(), "sha256").hexdigest()


def test_every_signature_gets_a_fresh_random_nonce() -> None:
    headers = {sign_request(KEY, "GET", PATH, b"", now=NOW) for _ in range(20)}
    assert len(headers) == 20


def test_a_caller_chosen_nonce_must_be_32_hex_digits() -> None:
    with pytest.raises(ValueError):
        sign_request(KEY, "GET", PATH, b"", now=NOW, nonce="short")


def test_the_verifier_repr_does_not_show_the_key() -> None:
    assert KEY.hex() not in repr(verifier())
    assert "redacted" in repr(verifier())


# --- acceptance ---


def test_a_signed_request_verifies() -> None:
    v = verifier()
    v.verify(
        sign_request(KEY, "POST", "/admin/v1/drain", b"{}", now=NOW),
        "POST",
        "/admin/v1/drain",
        b"{}",
    )
    v.verify(sign_request(KEY, "GET", PATH, b"", now=NOW), "GET", PATH, b"")


def test_clock_skew_inside_the_window_is_accepted_both_ways() -> None:
    v = verifier(Clock(NOW), window_s=60)
    v.verify(sign_request(KEY, "GET", PATH, b"", now=NOW - 60), "GET", PATH, b"")
    v.verify(sign_request(KEY, "GET", PATH, b"", now=NOW + 60), "GET", PATH, b"")


# --- refusals ---


def test_no_header_is_missing() -> None:
    assert refusal(verifier(), None, "GET", PATH, b"") == "missing"
    assert refusal(verifier(), "", "GET", PATH, b"") == "missing"


def test_a_different_key_is_bad_mac() -> None:
    other = admin_key(b"another cluster's secret, 32 b..")
    header = sign_request(other, "GET", PATH, b"", now=NOW)
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
    header = sign_request(KEY, "POST", "/admin/v1/drain", b"{}", now=NOW)
    assert refusal(verifier(), header, method, path, body) == "bad_mac"


@pytest.mark.parametrize("skew", [-61, 61, -10_000, 10**9])
def test_a_timestamp_outside_the_window_is_stale(skew: float) -> None:
    header = sign_request(KEY, "GET", PATH, b"", now=NOW + skew)
    assert refusal(verifier(window_s=60), header, "GET", PATH, b"") == "stale"


def test_the_same_request_twice_is_replayed() -> None:
    v = verifier()
    header = sign_request(KEY, "POST", "/admin/v1/drain", b"", now=NOW)
    v.verify(header, "POST", "/admin/v1/drain", b"")
    assert refusal(v, header, "POST", "/admin/v1/drain", b"") == "replayed"


def test_a_replay_after_the_window_is_stale_and_the_nonce_is_forgotten() -> None:
    clock = Clock()
    v = verifier(clock, window_s=60)
    header = sign_request(KEY, "GET", PATH, b"", now=NOW)
    v.verify(header, "GET", PATH, b"")
    clock.now = NOW + 61
    assert refusal(v, header, "GET", PATH, b"") == "stale"
    v.verify(sign_request(KEY, "GET", PATH, b"", now=clock.now), "GET", PATH, b"")
    assert v.remembered == 1


def test_a_forged_request_is_not_remembered() -> None:
    v = verifier()
    forged = sign_request(admin_key(b"x" * 32), "GET", PATH, b"", now=NOW, nonce="cd" * 16)
    refusal(v, forged, "GET", PATH, b"")
    assert v.remembered == 0
    # The genuine holder of the nonce is not locked out by the forgery.
    v.verify(sign_request(KEY, "GET", PATH, b"", now=NOW, nonce="cd" * 16), "GET", PATH, b"")


def test_nonce_memory_is_bounded_without_reopening_a_replay() -> None:
    clock = Clock()
    v = verifier(clock, max_nonces=3)
    headers = []
    for i in range(5):
        clock.now = NOW + i
        header = sign_request(KEY, "GET", PATH, b"", now=clock.now)
        v.verify(header, "GET", PATH, b"")
        headers.append(header)
        assert v.remembered <= 3
    # The two oldest were forgotten; their timestamps are refused from now on.
    for header in headers[:2]:
        assert refusal(v, header, "GET", PATH, b"") == "stale"
    for header in headers[2:]:
        assert refusal(v, header, "GET", PATH, b"") == "replayed"
    v.verify(sign_request(KEY, "GET", PATH, b"", now=clock.now), "GET", PATH, b"")


GOOD = sign_request(KEY, "GET", PATH, b"", now=NOW, nonce="ef" * 16)


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
        verifier().verify(header, "GET", PATH, b"")
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
        verifier().verify(header, "GET", PATH, b"")
    assert info.value.reason in AUTH_REASONS
