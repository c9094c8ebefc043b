"""The ``tcp`` backend (default): asyncio streams over plain TCP, works everywhere."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from mlxppd.wire.streams import STREAM_LIMIT, AsyncioByteStream, ByteStream
from mlxppd.wire.transport import Binding, Transport

__all__ = ["TcpTransport"]


class TcpTransport(Transport):
    """Secure channels over asyncio TCP streams."""

    backend = "tcp"

    async def _bind(self, host: str, port: int, on_stream: Callable[[ByteStream], None]) -> Binding:
        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            on_stream(AsyncioByteStream(reader, writer))

        server = await asyncio.start_server(accepted, host, port, limit=STREAM_LIMIT)
        address = server.sockets[0].getsockname()
        return Binding((address[0], address[1]), server.close, server.wait_closed)

    async def _open(self, host: str, port: int) -> ByteStream:
        reader, writer = await asyncio.open_connection(host, port, limit=STREAM_LIMIT)
        return AsyncioByteStream(reader, writer)
