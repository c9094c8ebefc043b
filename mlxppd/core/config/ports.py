"""``[cluster] transport_port_range``: the ports a node takes when none is given for it.

An operator opens one range in the firewall (docs/operations.md, "Ports and firewalls") and
every transport port mlxpp picks for itself (a local cluster's stages and coordinator) comes
from it. The TOML spells the range as one string, ``"39600-39629"`` (both ends included); a
single port is ``"39600-39600"``. Choosing ports is pure here: whether a port is free is asked
of a callable, which the runtime answers by trying to bind it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator, WithJsonSchema

from mlxppd.core.errors import ConfigurationError

__all__ = [
    "DEFAULT_TRANSPORT_PORT_RANGE",
    "TRANSPORT_PORT_RANGE_SETTING",
    "PortRange",
    "TransportPortRangeField",
    "choose_ports",
    "parse_port_range",
]

#: the default range: 30 ports, room for a local cluster of up to 29 stages and its coordinator
DEFAULT_TRANSPORT_PORT_RANGE = "39600-39629"
#: how errors name the setting
TRANSPORT_PORT_RANGE_SETTING = "cluster.transport_port_range"

_RANGE = re.compile(r"\s*(\d{1,5})\s*-\s*(\d{1,5})\s*")
_FIX = 'write it as "FIRST-LAST" with 1 <= FIRST <= LAST <= 65535, e.g. "39600-39629"'


@dataclass(frozen=True)
class PortRange:
    """Ports ``start`` to ``end``, both included."""

    start: int
    end: int

    def __str__(self) -> str:
        return f"{self.start}-{self.end}"

    def __len__(self) -> int:
        return self.end - self.start + 1

    def ports(self) -> range:
        return range(self.start, self.end + 1)


def parse_port_range(text: str) -> PortRange:
    """``"A-B"`` as a PortRange; ValueError saying what is wrong and how to write it."""
    match = _RANGE.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a port range; {_FIX}")
    start, end = int(match.group(1)), int(match.group(2))
    if not (1 <= start <= 65535 and 1 <= end <= 65535):
        raise ValueError(f"{text!r} has a port outside 1-65535; {_FIX}")
    if start > end:
        raise ValueError(f'{text!r} starts after it ends; write it as "{end}-{start}"')
    return PortRange(start, end)


def _canonical(text: str) -> str:
    return str(parse_port_range(text))


#: the TOML field: a string "A-B", stored in its canonical spelling so rendering is stable
TransportPortRangeField = Annotated[
    str,
    AfterValidator(_canonical),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": r"^\s*\d{1,5}\s*-\s*\d{1,5}\s*$",
        }
    ),
]


def choose_ports(
    port_range: PortRange,
    count: int,
    is_free: Callable[[int], bool],
    *,
    setting: str = TRANSPORT_PORT_RANGE_SETTING,
) -> tuple[int, ...]:
    """The first ``count`` ports of ``port_range``, in order, that ``is_free`` accepts.

    ConfigurationError naming ``setting`` and the range when the range is too small or too
    many of its ports are taken, with the fix.
    """
    if count > len(port_range):
        raise ConfigurationError(
            f"{port_range} holds {len(port_range)} ports but {count} are needed; widen it "
            f'(e.g. "{port_range.start}-{min(65535, port_range.start + count - 1)}") and open '
            "the wider range in the firewall",
            source=setting,
        )
    chosen: list[int] = []
    for port in port_range.ports():
        if is_free(port):
            chosen.append(port)
            if len(chosen) == count:
                return tuple(chosen)
    raise ConfigurationError(
        f"only {len(chosen)} of the {len(port_range)} ports in {port_range} are free but "
        f"{count} are needed; stop what holds them (another mlxpp cluster?), or give "
        "another or wider range and open it in the firewall",
        source=setting,
    )


def _portless(address: str) -> bool:
    """``host`` or ``[v6]`` with no ``:port`` (a bare IPv6 address is not accepted anyway)."""
    text = address.strip()
    if not text:
        return False
    if text.startswith("["):
        return text.endswith("]")
    return ":" not in text


def fill_node_ports(nodes: object, range_text: object) -> object:
    """A raw ``[[nodes]]`` list where each address written without a port gets one from the
    transport port range: the node's position in the file, counted from the range's first
    port, so every host reading the same file computes the same address. Anything else is
    returned unchanged for the models to check."""
    if not isinstance(nodes, list) or not any(
        isinstance(n, dict) and isinstance(n.get("address"), str) and _portless(n["address"])
        for n in nodes
    ):
        return nodes
    try:
        port_range = parse_port_range(str(range_text or DEFAULT_TRANSPORT_PORT_RANGE))
    except ValueError:
        return nodes  # the section's own validation names the bad range
    filled = []
    for index, node in enumerate(nodes):
        if isinstance(node, dict) and isinstance(node.get("address"), str):
            if _portless(node["address"]):
                if index >= len(port_range):
                    raise ValueError(
                        f"node {node.get('id')!r} (node {index + 1} of the file) has no port "
                        f'and {TRANSPORT_PORT_RANGE_SETTING} = "{port_range}" holds only '
                        f"{len(port_range)}; give it a port or widen the range"
                    )
                node = {**node, "address": f"{node['address'].strip()}:{port_range.start + index}"}
        filled.append(node)
    return filled


def with_range_port(address: str, range_text: str = DEFAULT_TRANSPORT_PORT_RANGE) -> str:
    """``address`` as given, or with the range's first port when it has none (a zero-config
    peer's ``HOST``: every host may use the same port)."""
    if not _portless(address):
        return address
    return f"{address.strip()}:{parse_port_range(range_text).start}"
