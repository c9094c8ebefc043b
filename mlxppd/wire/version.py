"""Protocol version numbers; both are exchanged before anything that depends on them."""

from __future__ import annotations

__all__ = ["PROTOCOL_VERSION", "RDMA_PROTOCOL_VERSION"]

#: Version of the whole wire protocol: handshake envelopes, records and message headers
#: (docs/protocol.md). Nodes of different versions refuse each other, naming both versions.
PROTOCOL_VERSION = 2

#: Version of the RDMA-aware fast path a node advertises in its hello; 0 means "not RDMA-aware".
RDMA_PROTOCOL_VERSION = 1
