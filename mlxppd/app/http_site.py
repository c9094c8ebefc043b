"""Listening with an aiohttp application: one way, whoever puts the node together."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from mlxppd.core.config.addresses import join_host_port


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port``; returns its runner (``cleanup()`` stops it) and the port
    bound (port 0 asks the OS for a free one)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server: Any = site._server
    sockets = server.sockets if server is not None else []
    return runner, int(sockets[0].getsockname()[1]) if sockets else port


def http_url(host: str, port: int) -> str:
    return f"http://{join_host_port(host, port)}"
