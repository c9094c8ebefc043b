"""Loading and unloading a per-request adapter on every stage while the cluster serves.

A load goes to every stage at once; each reads its own layers' tensors from the path on its
host and answers with their digest, which must equal the digest the coordinator takes from its
own copy over that stage's layers (a stage whose file differs is refused, and the adapter is
dropped everywhere). An unload first drains the adapter alone: new requests for it are refused
while those running finish; the rest of the cluster serves throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxppd.core.adapters import adapter_name_problem, wanted_by
from mlxppd.core.errors import ConfigurationError, TemporaryError
from mlxppd.core.log_text import escape
from mlxppd.core.protocol.adapters import AdapterLoad, AdapterReply, AdapterUnload
from mlxppd.core.protocol.model_transfer import Identify, IdentityReply
from mlxppd.core.stages import StageSpec
from mlxppd.core.strict import StrictModel
from mlxppd.engine.adapters.reader import adapter_digest, read_adapter_config
from mlxppd.runtime.backends.contract import BackendUnavailable
from mlxppd.runtime.coordinator.adapter_registry import AdapterRegistry
from mlxppd.runtime.coordinator.admission import SequenceAdmission
from mlxppd.runtime.coordinator.chain import StageChain
from mlxppd.runtime.coordinator.identity_check import IdentityReference
from mlxppd.runtime.coordinator.stage_link import StageLink

__all__ = ["AdapterChanges"]

log = logging.getLogger("mlxppd.coordinator")
#: reading an adapter is quick; a large one on a slow disk may take a while
LOAD_TIMEOUT_S = 300.0


def _wanted(spec: StageSpec, tied: bool, module: str) -> bool:
    return wanted_by(module, spec, tied)


class AdapterChanges:
    """Adapter loads and unloads on every stage of ``chain()``, one change at a time (a load
    racing an unload of one name would leave the stages and the registry disagreeing)."""

    def __init__(
        self,
        chain: Callable[[], StageChain],
        registry: AdapterRegistry,
        admission: SequenceAdmission,
        identity: IdentityReference | None,
        model_id: str,
    ) -> None:
        self._chain = chain
        self._registry = registry
        self._admission = admission
        self._identity = identity
        self._model_id = model_id
        self._lock = asyncio.Lock()

    def _expected_digests(self, path: Path, chain: StageChain) -> list[str | None]:
        """The digest each stage of ``chain`` should report, from the coordinator's copy (None:
        unknown)."""
        if self._identity is None or chain.plan is None:
            return [None] * len(chain.links)
        tied = bool(self._identity.config.get("tie_word_embeddings", False))
        out: list[str | None] = []
        for index, layers in enumerate(chain.plan):
            spec = StageSpec.holding(index, len(chain.plan), layers)
            out.append(adapter_digest(path, functools.partial(_wanted, spec, tied))[0])
        return out

    async def load(self, name: str, path: str) -> dict[str, Any]:
        """Hold adapter ``name`` on every stage; requests may choose it once this returns."""
        async with self._lock:
            return await self._load(name, path)

    async def unload(self, name: str, drain_timeout_s: float) -> dict[str, Any]:
        """Drain ``name``'s requests, then drop it on every stage."""
        async with self._lock:
            return await self._unload(name, drain_timeout_s)

    async def _load(self, name: str, path: str) -> dict[str, Any]:
        problem = adapter_name_problem(name)
        if problem is not None:
            raise ConfigurationError(problem, source="name")
        if name == self._model_id:
            raise ConfigurationError(
                f"{name!r} is the base model's name; give the adapter another", source="name"
            )
        if self._registry.path(name) is not None:
            # Swapping weights under running sequences would mix two adapters in one answer.
            raise ConfigurationError(
                f"adapter {name!r} is loaded already; unload it first (mlxppctl adapter "
                "unload), or load the new one under another name",
                source="name",
            )
        where = Path(path).expanduser()
        # A bad directory is refused here, before any stage (read off the event loop).
        await asyncio.to_thread(read_adapter_config, where)
        expected = await asyncio.to_thread(self._expected_digests, where, self._chain())
        replies = await asyncio.gather(
            *(
                self._ask_adapter(link, AdapterLoad(name=name, path=str(where)))
                for link in self._chain().links
            )
        )
        problems = []
        for index, (reply, want) in enumerate(zip(replies, expected, strict=True)):
            if not reply.ok:
                problems.append(f"stage {index}: {reply.error}")
            elif want is not None and reply.digest != want:
                problems.append(
                    f"stage {index}: its copy differs (sha256 {str(reply.digest)[:16]}, the "
                    f"coordinator's {want[:16]}); put the same files at {where} on every host"
                )
        if problems:
            await self._drop_everywhere(name)
            raise TemporaryError(f"adapter {name!r} was not loaded: " + "; ".join(problems))
        self._registry.add(name, where)
        log.info("coordinator: adapter %s loaded from %s on every stage", escape(name), where)
        return {
            "name": name,
            "path": str(where),
            "stages": [r.model_dump(exclude={"rid", "ok", "error"}) for r in replies],
        }

    async def supply(self, chain: StageChain) -> None:
        """Every stage of ``chain``, a new pipeline, holds every adapter the cluster serves:
        one a stage lacks (a standby that adopted a stage, a restarted node, each holding the
        cluster file's only) is loaded on it and checked against the coordinator's copy. One
        that cannot be loaded there is no longer served, rather than failing the pipeline."""
        named = {n: p for n, p in self._registry.paths().items() if n}
        if not named:
            return
        async with self._lock:
            replies = await asyncio.gather(
                *(chain.ask(link, Identify(), IdentityReply) for link in chain.links)
            )
            for index, reply in enumerate(replies):
                held = set(reply.identity.adapters) if reply.identity is not None else set()
                for name in sorted(set(named) - held):
                    problem = await self._load_on(chain, index, name, named[name])
                    if problem is not None:
                        log.error("coordinator: adapter %s is no longer served: %s",
                                  escape(name), problem)  # fmt: skip
                        await self._drop_everywhere(name, chain)
                        self._registry.remove(name)
                        named.pop(name)

    async def _load_on(self, chain: StageChain, index: int, name: str, path: Path) -> str | None:
        """Load adapter ``name`` on stage ``index`` of ``chain``; what went wrong, or None."""
        link = chain.links[index]
        reply = await self._ask_adapter(link, AdapterLoad(name=name, path=str(path)), chain)
        if not reply.ok:
            return f"stage {index} ({link.node.id}) could not load it: {reply.error}"
        want = (await asyncio.to_thread(self._expected_digests, path, chain))[index]
        if want is not None and reply.digest != want:
            return (f"stage {index} ({link.node.id}) holds another copy (sha256 "
                    f"{str(reply.digest)[:16]}, the coordinator's {want[:16]})")  # fmt: skip
        log.info("coordinator: adapter %s loaded on stage %d (%s), which lacked it",
                 escape(name), index, link.node.id)  # fmt: skip
        return None

    async def _unload(self, name: str, drain_timeout_s: float) -> dict[str, Any]:
        if self._registry.path(name) is None:
            raise ConfigurationError(f"no adapter named {name!r} is loaded", source="name")
        if not await self._registry.drain(name, drain_timeout_s):
            raise TemporaryError(
                f"adapter {name!r} still runs requests after {drain_timeout_s:g} s; it keeps "
                "serving, try again later"
            )
        await self._admission.forget_tag(name)
        await self._drop_everywhere(name)
        self._registry.remove(name)
        log.info("coordinator: adapter %s unloaded from every stage", escape(name))
        return {"name": name, "unloaded": True}

    async def _ask_adapter(
        self, link: StageLink, command: StrictModel, chain: StageChain | None = None
    ) -> AdapterReply:
        """A stage's answer; a stage lost meanwhile answers ``ok=False`` (the chain's error
        policy has turned its silence into BackendUnavailable), so the others drop it."""
        try:
            return await (chain or self._chain()).ask(link, command, AdapterReply, LOAD_TIMEOUT_S)
        except BackendUnavailable as exc:
            return AdapterReply(ok=False, error=f"no answer ({exc})")

    async def _drop_everywhere(self, name: str, chain: StageChain | None = None) -> None:
        chain = chain or self._chain()
        for link in chain.links:
            with contextlib.suppress(Exception):
                await self._ask_adapter(link, AdapterUnload(name=name), chain)
