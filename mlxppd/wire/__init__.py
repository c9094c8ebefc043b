"""wire layer of mlxppd (see DESIGN.md): bytes on the network, never mlx.

The public surface, by concept (docs/protocol.md has the byte layouts):

* secret: ``load_cluster_secret``, ``ClusterSecret``, ``write_new_secret``
* messages: ``Message``, ``MessageKind``, ``Tensor``, ``as_tensor``, ``DType``, ``FrameLimits``
* transports: ``create_transport(backend, WireConfig(...))`` -> ``Transport`` with
  ``listen(host, port, handler)`` and ``connect(host, port)`` -> ``SecureChannel``
* errors: ``FrameError``, ``HandshakeError``, ``VersionMismatchError``, ``PeerAtCapacityError``,
  ``ChannelClosedError``; counters: ``WireStats``
"""

from mlxppd.wire.backends import create_transport, wire_config_for
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import Message, MessageKind, Tensor, as_tensor
from mlxppd.wire.dtypes import DTYPES, DType, dtype_by_name
from mlxppd.wire.errors import (
    ChannelClosedError,
    FrameError,
    HandshakeError,
    MessageEncodingError,
    PeerAtCapacityError,
    VersionMismatchError,
)
from mlxppd.wire.limits import FrameLimits
from mlxppd.wire.rdma import RdmaState, RdmaTransport
from mlxppd.wire.secret import ClusterSecret, load_cluster_secret, write_new_secret
from mlxppd.wire.stats import WireStats
from mlxppd.wire.transport import Listener, Transport, WireConfig
from mlxppd.wire.version import PROTOCOL_VERSION, RDMA_PROTOCOL_VERSION

__all__ = [
    "DTYPES",
    "PROTOCOL_VERSION",
    "RDMA_PROTOCOL_VERSION",
    "ChannelClosedError",
    "ClusterSecret",
    "DType",
    "FrameError",
    "FrameLimits",
    "HandshakeError",
    "Listener",
    "Message",
    "MessageEncodingError",
    "MessageKind",
    "PeerAtCapacityError",
    "RdmaState",
    "RdmaTransport",
    "SecureChannel",
    "Tensor",
    "Transport",
    "VersionMismatchError",
    "WireConfig",
    "WireStats",
    "as_tensor",
    "create_transport",
    "dtype_by_name",
    "load_cluster_secret",
    "wire_config_for",
    "write_new_secret",
]
