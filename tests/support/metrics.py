"""Reading a live server's Prometheus metrics in a test."""

from __future__ import annotations

import httpx


def metric(client: httpx.Client, name: str) -> float:
    """The sum of a counter's or gauge's series in the server's /metrics (0 when absent)."""
    text = client.get("/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )
