"""A node's DNS-SD advertisement is believed only when signed with the cluster secret, for this
cluster, recently, and bounded in size (``mlxppd/wire/dnssd_advert.py``)."""

from __future__ import annotations

import pytest

from mlxppd.wire.dnssd_advert import (
    Advert,
    AdvertRejected,
    advert_key,
    advert_properties,
    instance_name,
    verify_advert,
)

KEY = advert_key(b"k" * 32)
ADVERT = Advert("stage-1", "lab", 39601, 8 << 30, "metal", "0.9.0", 1_700_000_000)
NAME = instance_name("stage-1", "lab")


def wire(props: dict[str, str]) -> dict[bytes, bytes | None]:
    """The properties as a browser receives them."""
    return {k.encode(): v.encode() for k, v in props.items()}


def verify(props: dict[bytes, bytes | None], name: str = NAME, port: int = 39601) -> Advert:
    return verify_advert(name, port, props, KEY, cluster="lab", now=1_700_000_010)


def reason(props: dict[bytes, bytes | None], **kw: object) -> str:
    with pytest.raises(AdvertRejected) as refused:
        verify(props, **kw)  # type: ignore[arg-type]
    return refused.value.reason


def test_a_signed_advertisement_reads_back() -> None:
    assert verify(wire(advert_properties(ADVERT, KEY))) == ADVERT


@pytest.mark.parametrize("field", ["id", "cl", "mem", "acc", "ver", "ts", "v"])
def test_any_changed_field_breaks_the_signature(field: str) -> None:
    props = wire(advert_properties(ADVERT, KEY))
    props[field.encode()] = b"7" + (props[field.encode()] or b"")
    assert reason(props) == "bad_mac"


def test_the_name_and_port_are_signed_too() -> None:
    props = wire(advert_properties(ADVERT, KEY))
    assert reason(props, port=39602) == "bad_mac"
    assert reason(props, name=instance_name("stage-2", "lab")) == "bad_mac"


def test_another_secret_another_cluster_and_old_ones_are_refused() -> None:
    assert reason(wire(advert_properties(ADVERT, advert_key(b"x" * 32)))) == "bad_mac"
    other = Advert("stage-1", "other", 39601, 1, "cpu", "0.9.0", 1_700_000_000)
    props = wire(advert_properties(other, KEY))
    with pytest.raises(AdvertRejected) as refused:
        verify_advert(instance_name("stage-1", "other"), 39601, props, KEY, cluster="lab",
                      now=1_700_000_000)  # fmt: skip
    assert refused.value.reason == "foreign"
    props = wire(advert_properties(ADVERT, KEY))
    with pytest.raises(AdvertRejected) as stale:
        verify_advert(NAME, 39601, props, KEY, cluster="lab", now=1_700_000_000 + 3600)
    assert stale.value.reason == "stale"


def test_unsigned_oversize_and_malformed_records_are_refused_before_the_mac() -> None:
    props = wire(advert_properties(ADVERT, KEY))
    assert reason({k: v for k, v in props.items() if k != b"sig"}) == "unsigned"
    assert reason({**props, **{f"x{i}".encode(): b"" for i in range(20)}}) == "oversize"
    assert reason({**props, b"id": b"\xff\xfe"}) == "malformed"
    assert reason({**props, b"acc": b"x" * 300}) == "malformed"
    assert reason({**props, b"ver": None}) == "malformed"


@pytest.mark.parametrize("node_id", ["", "a b", "x\n", "é", "a" * 64])
def test_a_node_id_that_cannot_be_advertised_is_a_value_error(node_id: str) -> None:
    with pytest.raises(ValueError):
        advert_properties(Advert(node_id, "lab", 1, 1, "cpu", "0.9.0", 1), KEY)
