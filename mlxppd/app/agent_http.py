"""The coordinator agent's HTTP listener: the OpenAI API, /metrics and the admin API on one port.

The agent (runtime) cannot import this layer, so the CLI hands ``start_agent_http`` to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from aiohttp import web

from mlxppd.app.api_app import api_app
from mlxppd.app.http_site import http_url, start_site
from mlxppd.core.agent.plan import CoordinatorTarget
from mlxppd.http.admin_api import signed_admin_api
from mlxppd.runtime.agent.loop import Agent
from mlxppd.runtime.agent.status import agent_admin
from mlxppd.runtime.pipeline.gated_backend import GatedBackend

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
    # The key is derived afresh from the secret in force; the name follows reloads.
    admin = signed_admin_api(
        agent_admin(agent),
        context.secret.key_bytes(),
        metrics,
        lambda: agent.context.cluster.cluster.name if agent.context else "",
    )
    app = api_app(
        backend,
        api_key=target.api_key,
        metrics=metrics if context.host.metrics else None,
        admin=admin,
    )
    runner, port = await start_site(app, target.http_host, target.http_port)
    url = http_url(target.http_host, port)
    log.info("coordinator: OpenAI API on %s/v1, admin API on %s/admin/v1", url, url)
    return AgentHttp(runner, url)
