"""The coordinator agent's HTTP listener: the OpenAI API, /metrics and the admin API on one port.

The agent (runtime) cannot import this layer, so the CLI hands ``start_agent_http`` to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from aiohttp import web

from mlxppd.app.api_app import api_app
from mlxppd.app.http_site import http_url, server_context, start_site
from mlxppd.core.agent.plan import CoordinatorTarget
from mlxppd.core.cpu_weights import float32_config
from mlxppd.core.profile.model import profile_from_config
from mlxppd.http.admin_api import signed_admin_api
from mlxppd.http.console_feed import ConsoleFeed
from mlxppd.runtime.agent.loop import Agent
from mlxppd.runtime.agent.status import agent_admin
from mlxppd.runtime.coordinator.gate import GatedBackend

log = logging.getLogger("mlxppd.http")


@dataclass
class AgentHttp:
    runner: web.AppRunner
    url: str

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_agent_http(
    backend: GatedBackend, target: CoordinatorTarget, agent: Agent
) -> AgentHttp:
    context = agent.context
    assert context is not None
    metrics = agent.metrics
    # The key is derived from the secret in force at start; the name and [operators] follow
    # reloads (a reload that lists operators turns the secret's signatures off at once).
    controller = agent_admin(agent)
    admin = signed_admin_api(
        controller,
        context.secret.key_bytes(),
        metrics,
        lambda: agent.context.cluster.cluster.name if agent.context else "",
        operators=lambda: agent.context.cluster.operators if agent.context else {},
    )
    runtime = agent.runtime
    config = context.model_config
    console = ConsoleFeed(
        controller, metrics, profile_from_config(config) if config else None, runtime.timeline,
        float32_profile=profile_from_config(float32_config(config)) if config else None,
    )  # fmt: skip
    app = api_app(
        backend,
        console,
        api_key=target.api_key,
        cors_origins=target.cors_origins,
        max_choices_per_request=target.max_choices_per_request,
        max_sequences=target.parallel,
        metrics=metrics,
        metrics_route=context.host.metrics,
        admin=admin,
    )
    tls = server_context(target.tls) if target.tls is not None else None
    runner, port = await start_site(app, target.http_host, target.http_port, tls=tls)
    url = http_url(target.http_host, port, tls=tls is not None)
    log.info("coordinator: OpenAI API on %s/v1, admin API on %s/admin/v1", url, url)
    log.info("coordinator: web console on %s/console", url)
    runtime.timeline.mark(f"HTTP API and console listening on {url}")
    return AgentHttp(runner, url)
