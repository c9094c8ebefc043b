"""The ``tcp`` backend (default): plain TCP through asyncio's transports, works everywhere."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from mlxppd.wire.protocol_stream import ProtocolByteStream
from mlxppd.wire.streams import ByteStream
from mlxppd.wire.transport import Binding, Transport

__all__ = ["TcpTransport"]


class TcpTransport(Transport):
    """Secure channels over asyncio TCP transports."""

    backend = "tcp"

    async def _bind(self, host: str, port: int, on_stream: Callable[[ByteStream], None]) -> Binding:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: ProtocolByteStream(on_connected=on_stream), host, port
        )
        address = server.sockets[0].getsockname()
        return Binding((address[0], address[1]), server.close, server.wait_closed)

    async def _open(self, host: str, port: int) -> ByteStream:
        loop = asyncio.get_running_loop()
        _, stream = await loop.create_connection(ProtocolByteStream, host, port)
        return stream
