"""The coordinator's whole HTTP API as one application: the base app (``http/base_app.py``:
middleware, limits, /health, /metrics) with the OpenAI API and the admin API on it
(``create_app``, ``http/openai_api.py``), the Anthropic Messages API (``http/anthropic_api.py``)
on the same backend, state and limits, its errors in its own shape, the OpenAPI document of
them all (``http/openapi.py``) at ``/openapi.json``, and a coordinator's web console
(``http/console.py``) at ``/console``. ``mlxppd serve`` and the agent's coordinator both build
it here."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from mlxppd.http.anthropic_api import add_anthropic_routes
from mlxppd.http.console import add_console_routes
from mlxppd.http.console_feed import ConsoleFeed
from mlxppd.http.ollama_api import add_ollama_routes
from mlxppd.http.openai_api import create_app
from mlxppd.http.openapi import add_openapi_route
from mlxppd.http.responses_api import add_responses_routes
from mlxppd.runtime.backends.contract import GenerationBackend


def api_app(
    backend: GenerationBackend, console: ConsoleFeed | None = None, **options: Any
) -> web.Application:
    """``create_app(backend, **options)`` with every API this server speaks, and the web
    console (``http/console.py``) when a coordinator gives its feed."""
    app = create_app(backend, **options)
    add_anthropic_routes(app)
    add_ollama_routes(app)  # Ollama's /api, for the UIs that speak it (docs/ollama-api.md)
    add_responses_routes(app)  # OpenAI's Responses API, its store at the default bounds
    if console is not None:
        add_console_routes(app, console)
    add_openapi_route(app)  # the document of these routes, built from their models
    return app
