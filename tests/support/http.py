"""A real OpenAI API server for tests: InProcessBackend + create_app on 127.0.0.1, own thread.

The server's event loop and the mlx thread live in the background; tests talk plain HTTP to it
(http.client, the openai package), the way a client would.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from mlxppd.app.api_app import api_app
from mlxppd.app.http_site import HttpGuardStats, HttpLimits, start_site
from mlxppd.core.layer_ranges import even_split
from mlxppd.http.openai_api import create_app
from mlxppd.runtime.backends.inprocess import InProcessBackend
from mlxppd.runtime.system.mlx_thread import MlxThread

T = TypeVar("T")
NUM_LAYERS = 30  # the embedded SmolLM2-135M
START_TIMEOUT_S = 120


class LoopThread:
    """An asyncio loop on its own thread serving aiohttp apps on 127.0.0.1; ``stop()`` fails
    the test when tasks are left behind on the loop."""

    def __init__(
        self,
        name: str,
        new_loop: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop,
    ) -> None:
        self._loop = new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name)
        self._thread.start()
        self._runners: list[web.AppRunner] = []

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run a coroutine on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def serve(
        self,
        app: web.Application,
        limits: HttpLimits | None = None,
        stats: HttpGuardStats | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> str:
        """Serve ``app`` on a free port (within ``limits``, counting into ``stats``, over TLS
        with ``tls``); its base URL."""

        async def start() -> str:
            # The nodes' own listener.
            runner, port = await start_site(app, "127.0.0.1", 0, limits, stats, tls)
            self._runners.append(runner)
            return f"{'https' if tls else 'http'}://127.0.0.1:{port}"

        return self.call(start())

    def stop(self) -> None:
        async def cleanup() -> None:
            for runner in self._runners:
                await runner.cleanup()
            # A test must not leave tasks behind on the loop.
            current = asyncio.current_task()
            left = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)
            if left:
                raise AssertionError(f"tasks left behind: {left}")

        try:
            if self._loop.is_running():
                self.call(cleanup())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()


class LiveServer(LoopThread):
    """``LiveServer(model_dir, num_stages)``; ``start_app(**create_app_options) -> base URL``."""

    def __init__(
        self, model_dir: Path, num_stages: int = 1, kv_budget_bytes: int | None = None
    ) -> None:
        super().__init__("http-test-loop")
        self.mlx = MlxThread(name="mlx-http-test")
        self.backend = InProcessBackend(
            model_dir,
            even_split(NUM_LAYERS, num_stages),
            self.mlx,
            model_id="smollm2-135m",
            kv_budget_bytes=kv_budget_bytes,
        )
        try:
            self.call(self.backend.start(), timeout=START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise

    def on_mlx(self, fn: Callable[[], T], timeout: float = 300) -> T:
        """Run ``fn`` on the server's one mlx thread (reference computations)."""
        return self.call(self.mlx.run(fn), timeout)

    def start_app(self, limits: HttpLimits | None = None, **options: Any) -> str:
        return self.serve(create_app(self.backend, **options), limits)

    def start_api(self, **options: Any) -> str:
        """Every API ``mlxppd serve`` serves (``app/api_app.py``), not only OpenAI's."""
        return self.serve(api_app(self.backend, **options), None)

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self.mlx.close()


# --- plain HTTP helpers (stdlib only) ---


def _connection(base_url: str, timeout: float) -> http.client.HTTPConnection:
    host, port = base_url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def request(
    base_url: str,
    method: str,
    path: str,
    body: Any = None,
    *,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    timeout: float = 120,
) -> tuple[int, dict[str, str], Any]:
    """One request -> (status, headers, parsed JSON body or text)."""
    conn = _connection(base_url, timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=all_headers)
        response = conn.getresponse()
        payload = response.read().decode()
        try:
            parsed: Any = json.loads(payload)
        except ValueError:
            parsed = payload
        return response.status, dict(response.getheaders()), parsed
    finally:
        conn.close()


def post(base_url: str, path: str, body: Any, **kwargs: Any) -> tuple[int, Any]:
    status, _, parsed = request(base_url, "POST", path, body, **kwargs)
    return status, parsed


def sse_events(response: http.client.HTTPResponse) -> Iterator[Any]:
    """Parsed ``data:`` payloads of an SSE response; ``"[DONE]"`` is yielded as the string."""
    while True:
        line = response.readline()
        if not line:
            return
        text = line.decode().rstrip("\r\n")
        if not text.startswith("data: "):
            continue
        data = text[len("data: ") :]
        yield data if data == "[DONE]" else json.loads(data)


def stream(
    base_url: str, path: str, body: dict[str, Any], timeout: float = 120
) -> tuple[int, list[Any]]:
    """A streaming request read to its end -> (status, events)."""
    conn = _connection(base_url, timeout)
    try:
        conn.request(
            "POST",
            path,
            body=json.dumps({**body, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        if response.status != 200:
            return response.status, [json.loads(response.read())]
        return response.status, list(sse_events(response))
    finally:
        conn.close()


def open_stream(
    base_url: str, path: str, body: dict[str, Any], timeout: float = 120
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """Start a streaming request and hand back the open connection (to drop it mid-stream)."""
    conn = _connection(base_url, timeout)
    conn.request(
        "POST",
        path,
        body=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    return conn, conn.getresponse()
