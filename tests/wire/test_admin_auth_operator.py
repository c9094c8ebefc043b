"""Operator-signed admin requests (``MLXPP-ED25519``): the header, what the signature covers,
every refusal, and the rule that once ``[operators]`` lists anyone the cluster secret's HMAC
signs nothing."""

from __future__ import annotations

import base64
import hashlib
import re

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from hypothesis import given
from hypothesis import strategies as st

from mlxppd.wire.admin_auth import (
    AUTH_REASONS,
    ED25519_SCHEME,
    MAX_HEADER_CHARS,
    SCHEME,
    AdminAuthError,
    AdminVerifier,
    admin_key,
    challenge,
    challenged_cluster,
    sign_operator_request,
    sign_request,
)
from mlxppd.wire.operator_key import OperatorKey, Operators

SECRET = b"0123456789abcdef0123456789abcdef"
NOW = 1_700_000_000.0
PATH = "/admin/v1/drain"
CLUSTER = "cluster-a"
HOST = "10.0.0.1:8080"
ALICE = OperatorKey.generate("alice")
BOB = OperatorKey.generate("bob")
LISTED = Operators.of({"alice": ALICE.public, "bob": BOB.public})


def sign(
    key: OperatorKey,
    method: str = "POST",
    path: str = PATH,
    body: bytes = b"{}",
    *,
    now: float = NOW,
    nonce: str | None = None,
    cluster: str = CLUSTER,
    host: str = HOST,
) -> str:
    return sign_operator_request(
        key, method, path, body, now=now, nonce=nonce, cluster=cluster, host=host
    )


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def verifier(operators: Operators = LISTED, clock: Clock | None = None) -> AdminVerifier:
    return AdminVerifier(
        admin_key(SECRET), cluster_name=CLUSTER, clock=clock or Clock(), operators=operators
    )


def refusal(
    v: AdminVerifier,
    header: str,
    method: str = "POST",
    path: str = PATH,
    body: bytes = b"{}",
    host: str = HOST,
) -> str:
    with pytest.raises(AdminAuthError) as info:
        v.verify(header, method, path, body, host=host)
    return info.value.reason


# --- the header ---


def test_the_header_names_the_operator_and_signs_the_documented_string() -> None:
    body = b'{"x": 1}'
    header = sign(ALICE, "post", body=body, now=NOW + 0.9, nonce="ab" * 16, host="Coord:8080")
    match = re.fullmatch(
        r"MLXPP-ED25519 name=alice,ts=(\d+),nonce=([0-9a-f]{32}),sig=([A-Za-z0-9+/]{86}==)",
        header,
    )
    assert match is not None
    assert (match[1], match[2]) == (str(int(NOW)), "ab" * 16)
    signed = "\n".join(
        [
            "MLXPP-ED25519",
            "alice",  # the scheme and the name first: a signature holds for one name only
            "POST",
            PATH,
            str(int(NOW)),
            "ab" * 16,
            hashlib.sha256(body).hexdigest(),
            CLUSTER,
            "coord:8080",
        ]
    )
    # Checked with the public key alone, as any Ed25519 library would.
    Ed25519PublicKey.from_public_bytes(ALICE.public).verify(
        base64.b64decode(match[3]), signed.encode()
    )


def test_the_operator_key_repr_shows_the_public_half_only() -> None:
    text = ALICE.file_text()
    private = text.strip().split(":", 1)[1]
    assert private not in repr(ALICE) and "redacted" in repr(ALICE)
    assert ALICE.public_text in repr(ALICE)


# --- acceptance ---


def test_a_listed_operators_signature_verifies() -> None:
    v = verifier()
    v.verify(sign(ALICE), "POST", PATH, b"{}", host=HOST)
    v.verify(sign(BOB, "GET", "/admin/v1/status", b""), "GET", "/admin/v1/status", b"", host=HOST)
    assert v.remembered == 2


def test_the_challenge_asks_for_the_scheme_in_force() -> None:
    assert verifier().scheme == ED25519_SCHEME
    assert verifier(Operators()).scheme == SCHEME
    header = challenge(CLUSTER, ED25519_SCHEME)
    assert header == 'MLXPP-ED25519 cluster="cluster-a"'
    assert challenged_cluster(header) == CLUSTER


# --- refusals ---


def test_an_hmac_from_the_cluster_secret_is_refused_once_operators_are_listed() -> None:
    hmac_header = sign_request(
        admin_key(SECRET), "POST", PATH, b"{}", now=NOW, cluster=CLUSTER, host=HOST
    )
    v = verifier()
    # Refused on the header alone: the body of a request from a stage host is never read.
    with pytest.raises(AdminAuthError, match="operator_key_required"):
        v.check_header(hmac_header)
    assert refusal(v, hmac_header) == "operator_key_required"
    # Without [operators] (legacy mode) the same header is let in.
    verifier(Operators()).verify(hmac_header, "POST", PATH, b"{}", host=HOST)


def test_an_unlisted_key_and_an_unknown_name_are_refused_alike() -> None:
    mallory = OperatorKey.generate("mallory")
    impostor = OperatorKey.generate("alice")  # claims alice's name with another key
    reasons = {refusal(verifier(), sign(key)) for key in (mallory, impostor)}
    assert reasons == {"bad_signature"}


def test_one_operators_signature_under_anothers_name_is_refused() -> None:
    header = sign(ALICE).replace("name=alice", "name=bob")
    assert refusal(verifier(), header) == "bad_signature"


def test_an_operator_signature_without_operators_listed_is_refused() -> None:
    assert refusal(verifier(Operators()), sign(ALICE)) == "bad_signature"


@pytest.mark.parametrize(
    ("method", "path", "body", "host"),
    [
        ("GET", PATH, b"{}", HOST),
        ("POST", "/admin/v1/resume", b"{}", HOST),
        ("POST", PATH + "?x=1", b"{}", HOST),
        ("POST", PATH, b'{"a": 1}', HOST),
        ("POST", PATH, b"{}", "10.0.0.2:8080"),
        ("POST", PATH, b"{}", "10.0.0.1:8081"),
    ],
    ids=["method", "path", "query", "body", "host", "port"],
)
def test_a_tampered_request_is_refused(method: str, path: str, body: bytes, host: str) -> None:
    assert refusal(verifier(), sign(ALICE), method, path, body, host) == "bad_signature"


def test_a_signature_for_another_cluster_is_refused() -> None:
    assert refusal(verifier(), sign(ALICE, cluster="cluster-b")) == "bad_signature"


def test_a_changed_timestamp_or_nonce_is_refused() -> None:
    header = sign(ALICE, nonce="ab" * 16)
    moved = header.replace(f"ts={int(NOW)}", f"ts={int(NOW) + 1}")
    assert refusal(verifier(), moved) == "bad_signature"
    renonced = header.replace("ab" * 16, "cd" * 16)
    assert refusal(verifier(), renonced) == "bad_signature"


@pytest.mark.parametrize("skew", [-61.0, 61.0])
def test_a_timestamp_outside_the_window_is_stale(skew: float) -> None:
    assert refusal(verifier(), sign(ALICE, now=NOW + skew)) == "stale"


def test_the_same_request_twice_is_replayed() -> None:
    v = verifier()
    header = sign(ALICE)
    v.verify(header, "POST", PATH, b"{}", host=HOST)
    assert refusal(v, header) == "replayed"


def test_a_forged_signature_is_not_remembered() -> None:
    v = verifier()
    forged = sign(OperatorKey.generate("alice"), nonce="ef" * 16)
    assert refusal(v, forged) == "bad_signature"
    assert v.remembered == 0
    v.verify(sign(ALICE, nonce="ef" * 16), "POST", PATH, b"{}", host=HOST)


def test_the_operators_may_follow_a_reload() -> None:
    listed = [Operators()]
    v = AdminVerifier(
        admin_key(SECRET), cluster_name=CLUSTER, clock=Clock(), operators=lambda: listed[0]
    )
    hmac_header = sign_request(
        admin_key(SECRET), "POST", PATH, b"{}", now=NOW, cluster=CLUSTER, host=HOST
    )
    v.verify(hmac_header, "POST", PATH, b"{}", host=HOST)
    listed[0] = Operators.of({"alice": ALICE.public})
    assert refusal(v, hmac_header) == "operator_key_required"
    v.verify(sign(ALICE), "POST", PATH, b"{}", host=HOST)
    listed[0] = Operators.of({"bob": BOB.public})  # alice removed: revoked at once
    assert refusal(v, sign(ALICE)) == "bad_signature"


GOOD = sign(ALICE, nonce="ef" * 16)


@pytest.mark.parametrize(
    "header",
    [
        "MLXPP-ED25519",
        "mlxpp-ed25519 " + GOOD.split(" ", 1)[1],
        GOOD.replace("name=alice", "name="),
        GOOD.replace("name=alice", "name=al ice"),
        GOOD.replace("name=alice,", ""),
        GOOD + ",name=bob",
        GOOD.replace("==", "="),  # not 64 bytes of base64
        GOOD.replace("sig=", "sig=AAAA"),
        GOOD.replace("sig=", "mac="),
        GOOD.replace(f"ts={int(NOW)}", "ts=1e9"),
    ],
)
def test_a_malformed_operator_header_is_malformed(header: str) -> None:
    assert refusal(verifier(), header) == "malformed"


def test_the_longest_name_fits_the_header_bound_and_longer_headers_are_refused() -> None:
    longest = OperatorKey.generate("n" * 255)
    header = sign(longest)
    assert len(header) <= MAX_HEADER_CHARS
    verifier(Operators.of({longest.name: longest.public})).verify(
        header, "POST", PATH, b"{}", host=HOST
    )
    assert refusal(verifier(), GOOD + "," + "x" * MAX_HEADER_CHARS) == "malformed"


@given(
    st.dictionaries(
        st.sampled_from(["name", "ts", "nonce", "sig", "x"]),
        st.text(alphabet="0123456789abcdefAZaz+/=-, ", max_size=100),
        max_size=5,
    )
)
def test_near_miss_operator_headers_are_refused_with_a_reason(fields: dict[str, str]) -> None:
    header = "MLXPP-ED25519 " + ",".join(f"{k}={v}" for k, v in fields.items())
    with pytest.raises(AdminAuthError) as info:
        verifier().verify(header, "POST", PATH, b"{}", host=HOST)
    assert info.value.reason in AUTH_REASONS
