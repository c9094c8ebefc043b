"""The coordinator's check that every stage serves the cluster's model.

The cluster's copy is the coordinator's model directory: for each stage the coordinator hashes
the tensors that stage's layers own (``engine/stage_digest.py``, cached by file) and compares
them, with the config, family and quantization, to the identity the stage reports
(``Identify``). A stage that differs, holds no copy, or cannot run the family is refused with
``ModelMismatch``: one sentence per stage, both digests named, so nothing wrong is served.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mlxppd.core.adapters import wanted_by
from mlxppd.core.errors import PermanentError
from mlxppd.core.model_identity import IdentityCheck, StageIdentity, check_stage
from mlxppd.core.protocol.model_transfer import Identify, IdentityReply
from mlxppd.core.stages import StageSpec
from mlxppd.engine.adapters.reader import adapter_digest
from mlxppd.engine.families import wire_family
from mlxppd.engine.stage_digest import stage_identity

log = logging.getLogger("mlxppd.coordinator")


class ModelMismatch(PermanentError):
    """A stage serves another model than the cluster's (or none, or cannot run it)."""

    def __init__(self, checks: list[IdentityCheck]):
        self.checks = checks
        refused = [c for c in checks if c.state in ("mismatch", "missing")]
        super().__init__("; ".join(c.detail for c in refused))


class IdentityReference:
    """The cluster's copy of the model, as the coordinator holds it."""

    def __init__(
        self,
        model_dir: Path,
        config: dict[str, Any],
        cache_dir: Path | None = None,
        adapters: Callable[[], Mapping[str, Path]] | None = None,
    ):
        self.model_dir = model_dir
        self.config = config
        self.cache_dir = cache_dir
        #: the cluster's adapters now, by name ('' = fused): their digests are expected too
        self.adapters = adapters or dict
        self.family = wire_family(config)
        self._expected: dict[tuple[int, int, int, int], StageIdentity] = {}

    def expected(self, spec: StageSpec) -> StageIdentity:
        key = (spec.index, spec.num_stages, spec.start, spec.end)
        if key not in self._expected:
            self._expected[key] = stage_identity(self.model_dir, spec, self.config, self.cache_dir)
        tied = bool(self.config.get("tie_word_embeddings", False))
        digests = {
            name: adapter_digest(path, lambda m: wanted_by(m, spec, tied))[0]
            for name, path in self.adapters().items()
        }
        return self._expected[key].model_copy(update={"adapters": digests})


async def check_links(
    reference: IdentityReference, links: list[Any], ask: Any
) -> list[IdentityCheck]:
    """Ask every stage (``links`` in stage order) what it serves and compare.

    ``ask(link, command, reply_type)`` sends one request on a link."""
    replies: list[IdentityReply] = await asyncio.gather(
        *(ask(link, Identify(), IdentityReply) for link in links)
    )
    checks = []
    for index, (link, reply) in enumerate(zip(links, replies, strict=True)):
        expected = None
        if reply.identity is not None:
            start, end = reply.identity.layers
            spec = StageSpec(index, len(links), start, end)
            expected = await asyncio.to_thread(reference.expected, spec)
        checks.append(
            check_stage(
                link.node.id,
                index,
                model_state=reply.model_state,
                family=reply.family,
                families=reply.families,
                actual=reply.identity,
                expected=expected,
                cluster_family=reference.family,
                detail=reply.detail,
            )
        )
    for check in checks:
        if check.state in ("mismatch", "missing"):
            log.error("coordinator: refusing %s", check.detail)
        elif check.state == "unverified":
            log.info("coordinator: stage %d (%s) unverified: %s", check.stage, check.node,
                     check.detail)  # fmt: skip
    return checks


def refuse_mismatches(checks: list[IdentityCheck]) -> None:
    if any(c.state in ("mismatch", "missing") for c in checks):
        raise ModelMismatch(checks)
