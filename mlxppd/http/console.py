"""The web console: ``GET /console``, one page shipped as package data (``console_static/``),
and the data it reads, under ``/console/v1/`` (the api key applies there when one is set):

- ``GET /console/v1/state``: a snapshot (``http/console_feed.py``);
- ``GET /console/v1/stream``: server-sent events, ``snapshot`` first, then one ``tick`` a
  second with the status and the new chart point;
- ``POST /console/v1/plan``: the plan the partitioner would make for a stage count and
  budgets (a what-if: nothing changes).

Actions (drain, resume, repartition) go to the signed admin API (``http/admin_api.py``); the
page signs them in the browser exactly as ``mlxppctl`` does, so the console adds no new way to
act. ``GET /`` links the console and the API's documents.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from mlxppd.core.errors import MlxppError
from mlxppd.http.base_app import read_bounded
from mlxppd.http.completion import ClientGone
from mlxppd.http.console_feed import ConsoleFeed, WhatIf
from mlxppd.http.errors import ApiError
from mlxppd.http.sse import SseWriter
from mlxppd.wire.tasks import spawn, stop_tasks

CONSOLE_PATH = "/console"
DATA_PREFIX = "/console/v1/"
#: the page's files: name -> content type (nothing else under /console/static is served)
STATIC = {
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    "sign.js": "text/javascript; charset=utf-8",
}
#: a what-if body is a stage count and a budget list
MAX_PLAN_BODY_BYTES = 8 * 1024
_FEED = web.AppKey("mlxpp_console_feed", ConsoleFeed)
# The page loads its own script and style and talks to this origin only.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_INDEX = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>mlxpp</title>
<meta name="viewport" content="width=device-width, initial-scale=1"></head>
<body><h1>mlxpp coordinator</h1><ul>
<li><a href="/console">Web console</a>: the cluster at a glance, live</li>
<li><a href="/openapi.json">OpenAPI document</a> of the HTTP API (<code>/v1</code>)</li>
<li><a href="/admin/v1/openapi.json">OpenAPI document</a> of the signed admin API
(<code>/admin/v1</code>)</li>
<li><a href="/health">Health</a></li>
</ul></body></html>
"""


def _asset(name: str) -> bytes:
    return resources.files("mlxppd.http").joinpath("console_static", name).read_bytes()


def add_console_routes(app: web.Application, feed: ConsoleFeed) -> None:
    """Serve the console from ``app`` and run ``feed``'s sampling while the app runs."""
    app[_FEED] = feed
    app.cleanup_ctx.append(_sampling)
    # on_shutdown runs before the server waits for open requests: end the pages' streams.
    app.on_shutdown.append(_close_streams)
    app.router.add_get("/", _index, allow_head=False)
    app.router.add_get(CONSOLE_PATH, _page, allow_head=False)
    app.router.add_get(CONSOLE_PATH + "/static/{name}", _static, allow_head=False)
    app.router.add_get(DATA_PREFIX + "state", _state, allow_head=False)
    app.router.add_get(DATA_PREFIX + "stream", _stream, allow_head=False)
    app.router.add_post(DATA_PREFIX + "plan", _plan)


async def _sampling(app: web.Application) -> AsyncIterator[None]:
    task = spawn(app[_FEED].run(), name="console-feed")
    yield
    await stop_tasks(task)


async def _close_streams(app: web.Application) -> None:
    app[_FEED].close()


def _headers(content_type: str) -> dict[str, str]:
    return {
        "Content-Type": content_type,
        "Cache-Control": "no-store",
        "Content-Security-Policy": _CSP,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }


async def _index(request: web.Request) -> web.Response:
    return web.Response(body=_INDEX.encode(), headers=_headers("text/html; charset=utf-8"))


async def _page(request: web.Request) -> web.Response:
    return web.Response(body=_asset("index.html"), headers=_headers("text/html; charset=utf-8"))


async def _static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in STATIC:
        raise ApiError(404, "no such console file", code="not_found")
    return web.Response(body=_asset(name), headers=_headers(STATIC[name]))


def _json(document: dict[str, Any], status: int = 200) -> web.Response:
    return web.json_response(document, status=status, headers={"Cache-Control": "no-store"})


async def _state(request: web.Request) -> web.Response:
    return _json(await request.app[_FEED].snapshot())


async def _stream(request: web.Request) -> web.StreamResponse:
    feed = request.app[_FEED]
    queue = feed.listen()
    if queue is None:
        raise ApiError(
            503, "too many console pages are open, or the server is stopping; retry shortly",
            type="server_overloaded", code="too_many_listeners", headers={"Retry-After": "5"},
        )  # fmt: skip
    try:
        first = await feed.snapshot()
        writer = await SseWriter.open(request, {})
        await writer.named("snapshot", first)
        while True:
            try:
                tick = await asyncio.wait_for(queue.get(), timeout=15)
            except TimeoutError:
                await writer.comment("keep-alive")  # proxies close idle streams
                continue
            if tick is None:
                await writer.close()
                return writer.response
            await writer.named("tick", tick)
    except ClientGone:
        return web.Response(status=499)
    finally:
        feed.leave(queue)


async def _plan(request: web.Request) -> web.Response:
    raw = await read_bounded(request, MAX_PLAN_BODY_BYTES, "a plan request")
    try:
        body = WhatIf.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise ApiError(400, f"{where}: {first['msg']}", code="invalid_plan_request") from None
    try:
        return _json(request.app[_FEED].what_if(body))
    except MlxppError as exc:
        raise ApiError(422, str(exc), code="no_plan") from None
