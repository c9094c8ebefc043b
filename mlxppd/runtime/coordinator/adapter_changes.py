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
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from mlxppd.core.adapters import adapter_name_problem, wanted_by
from mlxppd.core.errors import ConfigurationError, TemporaryError
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.log_text import escape
from mlxppd.core.protocol.adapters import AdapterLoad, AdapterReply, AdapterUnload
from mlxppd.core.stages import StageSpec
from mlxppd.core.strict import StrictModel
from mlxppd.engine.adapters.reader import adapter_digest, read_adapter_config
from mlxppd.runtime.coordinator.adapter_registry import AdapterRegistry
from mlxppd.runtime.coordinator.identity_check import IdentityReference
from mlxppd.runtime.coordinator.stage_link import StageLink
from mlxppd.wire.errors import ChannelClosedError, FrameError

__all__ = ["AdapterOps"]

ReplyT = TypeVar("ReplyT", bound=StrictModel)
log = logging.getLogger("mlxppd.coordinator")
#: reading an adapter is quick; a large one on a slow disk may take a while
LOAD_TIMEOUT_S = 300.0


def _wanted(spec: StageSpec, tied: bool, module: str) -> bool:
    return wanted_by(module, spec, tied)


class AdapterOps:
    """Adapter changes on every stage (mixed into ``Coordinator``)."""

    adapters: AdapterRegistry
    identity: IdentityReference | None
    plan: tuple[LayerRange, ...] | None
    _model_id: str
    _links: list[StageLink]

    if TYPE_CHECKING:  # provided by Coordinator

        async def _request(
            self, link: StageLink, command: StrictModel, reply: type[ReplyT],
            timeout_s: float = ..., payload: Any = None,
        ) -> ReplyT: ...  # fmt: skip

        async def forget_prompts(self, entries: list[str]) -> None: ...

        prompts: Any

    def _expected_digests(self, path: Path) -> list[str | None]:
        """The digest each stage should report, from the coordinator's copy (None: unknown)."""
        if self.identity is None or self.plan is None:
            return [None] * len(self._links)
        tied = bool(self.identity.config.get("tie_word_embeddings", False))
        out: list[str | None] = []
        for index, layers in enumerate(self.plan):
            spec = StageSpec(index, len(self.plan), layers.start, layers.end)
            out.append(adapter_digest(path, functools.partial(_wanted, spec, tied))[0])
        return out

    def _adapter_lock(self) -> asyncio.Lock:
        """One adapter change at a time (a load racing an unload of one name would leave the
        stages and the registry disagreeing)."""
        lock: asyncio.Lock | None = getattr(self, "_adapter_changes", None)
        if lock is None:
            lock = asyncio.Lock()
            self._adapter_changes = lock
        return lock

    async def load_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Hold adapter ``name`` on every stage; requests may choose it once this returns."""
        async with self._adapter_lock():
            return await self._load_adapter(name, path)

    async def unload_adapter(self, name: str, drain_timeout_s: float) -> dict[str, Any]:
        """Drain ``name``'s requests, then drop it on every stage."""
        async with self._adapter_lock():
            return await self._unload_adapter(name, drain_timeout_s)

    async def _load_adapter(self, name: str, path: str) -> dict[str, Any]:
        problem = adapter_name_problem(name)
        if problem is not None:
            raise ConfigurationError(problem, source="name")
        if name == self._model_id:
            raise ConfigurationError(
                f"{name!r} is the base model's name; give the adapter another", source="name"
            )
        if self.adapters.path(name) is not None:
            # Swapping weights under running sequences would mix two adapters in one answer.
            raise ConfigurationError(
                f"adapter {name!r} is loaded already; unload it first (mlxppctl adapter "
                "unload), or load the new one under another name",
                source="name",
            )
        where = Path(path).expanduser()
        # A bad directory is refused here, before any stage (read off the event loop).
        await asyncio.to_thread(read_adapter_config, where)
        expected = await asyncio.to_thread(self._expected_digests, where)
        replies = await asyncio.gather(
            *(
                self._ask_adapter(link, AdapterLoad(name=name, path=str(where)))
                for link in self._links
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
        self.adapters.add(name, where)
        log.info("coordinator: adapter %s loaded from %s on every stage", escape(name), where)
        return {
            "name": name,
            "path": str(where),
            "stages": [r.model_dump(exclude={"rid", "ok", "error"}) for r in replies],
        }

    async def _unload_adapter(self, name: str, drain_timeout_s: float) -> dict[str, Any]:
        if self.adapters.path(name) is None:
            raise ConfigurationError(f"no adapter named {name!r} is loaded", source="name")
        if not await self.adapters.drain(name, drain_timeout_s):
            raise TemporaryError(
                f"adapter {name!r} still runs requests after {drain_timeout_s:g} s; it keeps "
                "serving, try again later"
            )
        if self.prompts is not None:
            gone = self.prompts.forget_tag(name)
            if gone:
                await self.forget_prompts(gone)
        await self._drop_everywhere(name)
        self.adapters.remove(name)
        log.info("coordinator: adapter %s unloaded from every stage", escape(name))
        return {"name": name, "unloaded": True}

    async def _ask_adapter(self, link: StageLink, command: StrictModel) -> AdapterReply:
        try:
            return await self._request(link, command, AdapterReply, timeout_s=LOAD_TIMEOUT_S)
        except (ChannelClosedError, FrameError, TimeoutError) as exc:
            return AdapterReply(ok=False, error=f"no answer ({type(exc).__name__})")

    async def _drop_everywhere(self, name: str) -> None:
        for link in self._links:
            with contextlib.suppress(Exception):
                await self._ask_adapter(link, AdapterUnload(name=name))
