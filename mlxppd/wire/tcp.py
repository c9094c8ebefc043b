"""The ``tcp`` backend (default): plain TCP through asyncio's transports, works everywhere."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from mlxppd.wire.protocol_stream import ProtocolByteStream
from mlxppd.wire.streams import ByteStream
from mlxppd.wire.transport import Binding, Transport

__all__ = ["LISTEN_BACKLOG", "TcpTransport"]

#: connections the kernel queues before the listener accepts them (asyncio's default is 100)
LISTEN_BACKLOG = 1024


class TcpTransport(Transport):
    """Secure channels over asyncio TCP transports."""

    backend = "tcp"

    async def _bind(self, host: str, port: int, on_stream: Callable[[ByteStream], None]) -> Binding:
        loop = asyncio.get_running_loop()
        # A deep backlog: under a connection flood the caps close the excess at once, and
        # the peers that belong should not find the queue full meanwhile.
        server = await loop.create_server(
            lambda: ProtocolByteStream(on_connected=on_stream), host, port, backlog=LISTEN_BACKLOG
        )
        address = server.sockets[0].getsockname()
        return Binding((address[0], address[1]), server.close, server.wait_closed)

    async def _open(self, host: str, port: int) -> ByteStream:
        loop = asyncio.get_running_loop()
        _, stream = await loop.create_connection(ProtocolByteStream, host, port)
        return stream
