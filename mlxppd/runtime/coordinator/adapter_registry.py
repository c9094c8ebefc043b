"""The coordinator's record of the per-request adapters the cluster serves.

A request's ``model`` names one of them (or the base model); the registry says which are
serving, counts the requests running each, and drains one before it is unloaded: from the
moment an unload starts, a new request for it is refused while those running finish.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mlxppd.core.config.cluster import ClusterConfig
from mlxppd.runtime.backends.contract import RequestRefused

__all__ = ["AdapterRegistry"]


@dataclass
class _Entry:
    path: Path
    running: int = 0
    draining: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)


class AdapterRegistry:
    def __init__(self, fused: Path | None = None, named: Mapping[str, Path] | None = None):
        #: the adapter fused into every stage's weights (None: none)
        self.fused = fused
        self._named: dict[str, _Entry] = {n: _Entry(p) for n, p in (named or {}).items()}

    @staticmethod
    def of(cluster: ClusterConfig) -> AdapterRegistry:
        fused = cluster.cluster.adapter
        return AdapterRegistry(
            Path(fused).expanduser() if fused else None,
            {a.name: Path(a.path).expanduser() for a in cluster.adapters},
        )

    def names(self) -> list[str]:
        """The adapters requests may choose now, in name order."""
        return sorted(n for n, e in self._named.items() if not e.draining)

    def path(self, name: str) -> Path | None:
        entry = self._named.get(name)
        return entry.path if entry is not None else None

    def paths(self) -> dict[str, Path]:
        """Every adapter a stage should hold now, by name ('' = the fused one)."""
        out = {n: e.path for n, e in self._named.items()}
        if self.fused is not None:
            out[""] = self.fused
        return out

    def chosen(self, model: str | None) -> str | None:
        """The adapter a request's ``model`` picks (None: the base model)."""
        if model is None:
            return None
        entry = self._named.get(model)
        if entry is None:
            return None
        if entry.draining:
            raise RequestRefused(f"adapter {model!r} is being unloaded; choose another model")
        return model

    def begin(self, name: str | None) -> None:
        """One more request running adapter ``name`` (refused while it is being unloaded)."""
        if name is None:
            return
        entry = self._named.get(name)
        if entry is None:
            raise RequestRefused(f"adapter {name!r} is no longer served; choose another model")
        if entry.draining:
            raise RequestRefused(f"adapter {name!r} is being unloaded; choose another model")
        entry.running += 1
        entry.idle.clear()

    def end(self, name: str | None) -> None:
        entry = self._named.get(name) if name is not None else None
        if entry is None or entry.running == 0:
            return
        entry.running -= 1
        if entry.running == 0:
            entry.idle.set()

    def add(self, name: str, path: Path) -> None:
        self._named[name] = _Entry(path)

    async def drain(self, name: str, timeout_s: float) -> bool:
        """Refuse new requests for ``name`` and wait for those running (False: timed out, and
        it serves again)."""
        entry = self._named.get(name)
        if entry is None:
            return True
        entry.draining = True
        if entry.running == 0:
            return True
        try:
            await asyncio.wait_for(entry.idle.wait(), timeout_s)
        except TimeoutError:
            entry.draining = False
            return False
        return True

    def remove(self, name: str) -> None:
        self._named.pop(name, None)

    def usage(self) -> dict[str, int]:
        return {n: e.running for n, e in sorted(self._named.items())}
