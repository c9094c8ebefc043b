"""The coordinator's link to one stage: its node, the secure channel, typed requests on it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from mlxppd.core.config.cluster import Node
from mlxppd.runtime.coordinator.control_client import ControlClient
from mlxppd.wire.channel import SecureChannel


@dataclass
class StageLink:
    node: Node
    channel: SecureChannel
    control: ControlClient
    reader: asyncio.Task[None] | None = None
    """the task reading the stage's messages (tokens, replies, heartbeats)"""
    alive: bool = True
    """False once the link failed or was dropped"""
    configured: bool = False
    """the stage was told its place in the chain: from then on it sends heartbeats"""
