"""The sending end of ``mlxppctl prepare``: ship one stage node the tensors its layers need,
and the model directory's tokenizer files (``engine/prepared_files.py``).

Over the stage's own authenticated, encrypted channel (no other port): offer the cluster's
records of the stage's tensors and files, hear which the node lacks (``present``, ``missing`` or
``mismatch``) and how many bytes an interrupted try left there, stream the rest in chunks,
optionally at a capped rate, then ask the node to verify and install. Progress is one
:class:`ShipProgress` per node, which status documents and the terminal show.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlxppd.core.config.cluster import Node
from mlxppd.core.model_identity import TensorRecord
from mlxppd.core.protocol.model_transfer import (
    PrepareCheck,
    PrepareCommit,
    PrepareData,
    PrepareManifest,
    PrepareResult,
    PrepareState,
)
from mlxppd.core.stages import StageSpec
from mlxppd.engine.prepared_files import HeldFile, model_files_of
from mlxppd.engine.stage_digest import StoredTensor, iter_chunks, stage_tensors_of
from mlxppd.runtime.coordinator.control_client import ControlClient
from mlxppd.wire.transport import Transport

log = logging.getLogger("mlxppd.prepare")

CHUNK_BYTES = 1 << 20
#: verifying and installing hashes the copy twice: allow a slow disk its time
COMMIT_TIMEOUT_S = 1800.0


@dataclass
class ShipProgress:
    """One node's prepare, as status shows it (bytes; seconds on the injected clock)."""

    node: str
    stage: int
    layers: tuple[int, int]
    state: str = "waiting"
    """waiting, checking, sending, verifying, done, failed"""
    found: str = ""
    """what the node held: present, missing or mismatch"""
    tensors_needed: int = 0
    bytes_total: int = 0
    """bytes of the tensors and files the node lacked"""
    bytes_resumed: int = 0
    """of those, already on the node from an interrupted try (not sent again)"""
    bytes_sent: int = 0
    stage_bytes: int = 0
    """bytes of every tensor and file the stage needs (what a full copy would send)"""
    error: str | None = None
    started: float | None = None
    finished: float | None = None
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def rate(self) -> float:
        """Bytes per second sent so far."""
        if self.started is None:
            return 0.0
        elapsed = (self.finished or self.clock()) - self.started
        return self.bytes_sent / elapsed if elapsed > 0 else 0.0

    def eta_s(self) -> float | None:
        left = self.bytes_total - self.bytes_resumed - self.bytes_sent
        rate = self.rate()
        if self.state != "sending" or rate <= 0:
            return None
        return left / rate


def manifest_for(
    source: Path,
    spec: StageSpec,
    config: dict[str, Any],
    model_name: str,
    cache_dir: Path | None = None,
) -> tuple[PrepareManifest, dict[str, StoredTensor]]:
    """The cluster's records of what stage ``spec`` needs, from the copy in ``source`` (its
    files travel to every stage: a layer move or an adoption can make any stage the last)."""
    tensors = stage_tensors_of(source, spec, config, cache_dir)
    files = model_files_of(source)
    manifest = PrepareManifest(
        model_name=model_name,
        config=config,
        layers=(spec.start, spec.end),
        stage=spec.index,
        num_stages=spec.num_stages,
        records=[t.record for t in sorted(tensors.values(), key=lambda t: t.record.name)],
        files=[f.record for f in files.values()],
    )
    return manifest, tensors


def files_for(source: Path, manifest: PrepareManifest) -> dict[str, HeldFile]:
    """Where the manifest's files lie in ``source`` (``ship_stage``'s ``files``)."""
    return {f.name: HeldFile(f, source / f.name) for f in manifest.files}


async def ship_stage(
    transport: Transport,
    node: Node,
    manifest: PrepareManifest,
    tensors: dict[str, StoredTensor],
    progress: ShipProgress,
    *,
    files: Mapping[str, HeldFile] | None = None,
    max_rate_bytes_s: float | None = None,
    reply_timeout_s: float = 120.0,
    chunk_bytes: int = CHUNK_BYTES,
) -> PrepareResult | None:
    """Bring ``node``'s copy of its stage's tensors and the manifest's files (which lie at
    ``files``) to the cluster's; None when it had them."""
    files = files or {}
    progress.state, progress.error = "checking", None
    progress.stage_bytes = sum(r.nbytes for r in manifest.records)
    progress.stage_bytes += sum(f.nbytes for f in manifest.files)
    channel = await transport.connect(node.host, node.port, expected_peer=node.id)
    control = ControlClient(channel, reply_timeout_s)
    reader = asyncio.ensure_future(control.read_replies())
    try:
        payload = np.frombuffer(manifest.model_dump_json().encode(), dtype=np.uint8)
        state, names = await control.ask_with_payload(PrepareCheck(), PrepareState, payload=payload)
        if not state.ok:
            raise RuntimeError(f"{node.id} refused the prepare: {state.error}")
        needed: list[str] = json.loads(names or b"[]")
        if not isinstance(needed, list) or any(n not in tensors for n in needed):
            raise RuntimeError(f"{node.id} asked for tensors that stage does not own")
        if any(n not in files for n in state.files):
            raise RuntimeError(f"{node.id} asked for files the manifest does not list")
        progress.found = state.state
        progress.tensors_needed = len(needed)
        progress.bytes_total, progress.bytes_resumed = state.needed_bytes, state.have_bytes
        if not needed and not state.files:
            progress.state = "done"
            return None
        progress.state, progress.started = "sending", progress.clock()
        chosen = [tensors[n] for n in needed] + [_as_stored(files[n]) for n in state.files]
        await _stream(control, chosen, progress, max_rate_bytes_s, chunk_bytes)
        progress.state = "verifying"
        result = await control.ask(PrepareCommit(), PrepareResult, timeout_s=COMMIT_TIMEOUT_S)
        if not result.ok:
            raise RuntimeError(f"{node.id} refused what was sent: {result.error}")
        progress.state, progress.finished = "done", progress.clock()
        return result
    finally:
        await channel.close()
        reader.cancel()


def _as_stored(held: HeldFile) -> StoredTensor:
    """A file as a stream item: its bytes from offset 0, under its size (the chunker reads
    only the record's name and byte count; dtype and shape are placeholders)."""
    record = TensorRecord(
        name=held.record.name, dtype="U8", shape=[held.record.nbytes],
        nbytes=held.record.nbytes, sha256=held.record.sha256,
    )  # fmt: skip
    return StoredTensor(record, held.path, 0)


async def _stream(
    control: ControlClient,
    tensors: list[StoredTensor],
    progress: ShipProgress,
    max_rate_bytes_s: float | None,
    chunk_bytes: int,
) -> None:
    """The items' bytes back to back, from where the node's copy of the stream ends."""
    offset, skip = 0, progress.bytes_resumed
    began = time.monotonic()
    for tensor in tensors:
        size = tensor.record.nbytes
        if skip >= size:
            skip -= size
            offset += size
            continue
        offset += skip
        for chunk in iter_chunks(tensor, skip, chunk_bytes):
            data = np.frombuffer(chunk, dtype=np.uint8)
            await control.tell(PrepareData(offset=offset), data)
            offset += len(chunk)
            progress.bytes_sent += len(chunk)
            if max_rate_bytes_s:
                # Pace to the cap: sleep until the bytes sent so far are due.
                due = began + progress.bytes_sent / max_rate_bytes_s
                await asyncio.sleep(max(0.0, due - time.monotonic()))
        skip = 0
