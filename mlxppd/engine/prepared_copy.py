"""A node's prepared copy: the tensors ``mlxppctl prepare`` shipped it, verified, on disk.

Layout under ``<model cache>/prepared/<model name>/``:

```
current/            the installed copy: config.json, model.safetensors, prepared.json, and
                    the model directory's tokenizer files (``engine/prepared_files.py``)
incoming/           a transfer in progress: plan.json (the tensors, then the files, to
                    receive, in order) and data.part (their bytes back to back, as received)
```

A transfer appends to ``data.part``; an interrupted one resumes where the file ends, so no
byte is sent twice. Commit hashes every received tensor and file against the cluster's
record: one that differs is dropped (with everything after it) and nothing is installed. The
copy is built in a sibling directory (the tensors and files this node already held, copied
locally, plus the received ones) and hashed again from disk there; only a copy holding exactly
the manifest's tensors and files is renamed into place, so a failure at any step leaves the
installed copy as it was. A stage loads from ``current/`` only when every tensor it needs is
there and still matches ``prepared.json`` (``stage_model_dir``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.log_text import escape
from mlxppd.core.model_identity import (
    StageIdentity,
    TensorRecord,
    Triage,
    identity_of,
    triage,
)
from mlxppd.core.protocol.model_transfer import (
    MAX_CHUNK_BYTES,
    FileRecord,
    PrepareManifest,
    PrepareResult,
    PrepareState,
)
from mlxppd.core.stages import StageSpec
from mlxppd.engine.prepared_files import (
    ShortSource,
    copy_bytes,
    copy_range,
    find_local,
    sha256_of,
)
from mlxppd.engine.stage_digest import (
    StoredTensor,
    hash_range,
    stage_wanted,
    stored_tensors,
)

log = logging.getLogger("mlxppd.prepare")


def prepared_root(cache_dir: Path, model_name: str) -> Path:
    return cache_dir / "prepared" / model_name


@dataclass(frozen=True)
class PreparedInfo:
    layers: tuple[int, int]
    stage: int
    num_stages: int
    records: dict[str, TensorRecord]

    def covers(self, spec: StageSpec) -> bool:
        """Every tensor ``spec`` owns is in this copy (its layers, and the ends it needs)."""
        first, last = self.stage == 0, self.stage == self.num_stages - 1
        return (
            self.layers[0] <= spec.start
            and spec.end <= self.layers[1]
            and (first or not spec.has_embedding)
            and (last or not spec.has_lm_head)
        )


def read_prepared(copy: Path) -> PreparedInfo | None:
    """The installed copy's description, or None when there is none (or it is unreadable)."""
    try:
        data = json.loads((copy / "prepared.json").read_text())
        records = [TensorRecord.model_validate(r) for r in data["records"]]
        start, end = (int(x) for x in data["layers"])
        return PreparedInfo(
            (start, end), int(data["stage"]), int(data["num_stages"]), {r.name: r for r in records}
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def has_model(path: Path | None) -> bool:
    return path is not None and (path / "config.json").is_file()


def stage_model_dir(
    configured: Path | None,
    root: Path | None,
    spec: StageSpec,
    config: dict[str, Any],
    cache_dir: Path | None = None,
) -> Path:
    """Where stage ``spec`` reads its tensors: the prepared copy when it covers the stage's
    layers (and still matches the digests verified when it was installed), else the configured
    directory. A prepared copy that fails its digests is refused with a sentence, never loaded."""
    copy = root / "current" if root is not None else None
    info = read_prepared(copy) if copy is not None else None
    if copy is None or info is None or not info.covers(spec):
        if not has_model(configured):
            held = f" (its prepared copy covers layers {info.layers})" if info else ""
            raise ConfigurationError(
                f"this node holds no copy of the model for layers {spec.start}-{spec.end - 1}"
                f"{held}; run `mlxppctl prepare` on the coordinator's host to ship it"
            )
        assert configured is not None
        return configured
    wanted = stage_wanted(spec, config)
    on_disk = stored_tensors(copy, wanted, cache_dir)
    for name, record in info.records.items():
        stored = on_disk.get(name)
        if wanted(name) and (stored is None or stored.record != record):
            raise ConfigurationError(
                f"the prepared copy's tensor {name} no longer matches the digest verified when "
                "it was installed; it is not loaded. Run `mlxppctl prepare` again to replace it",
                source=str(copy),
            )
    return copy


class TransferError(Exception):
    """A received transfer failed verification (reported to the sender, nothing installed)."""


class ModelReceiver:
    """The receiving end of ``mlxppctl prepare`` on one node."""

    def __init__(
        self,
        root: Path,
        configured: Path | None,
        cache_dir: Path | None = None,
        on_installed: Callable[[StageIdentity], None] | None = None,
    ) -> None:
        self.root = root
        self.configured = configured
        self.cache_dir = cache_dir
        self.on_installed = on_installed
        self._manifest: PrepareManifest | None = None
        self._needed: list[TensorRecord] = []
        self._local: dict[str, StoredTensor] = {}
        #: the manifest's files to receive (after the tensors), and those held here
        self._needed_files: list[FileRecord] = []
        self._local_files: dict[str, Path] = {}
        self._total = 0
        #: bytes received by this process (progress), and bytes found from an earlier try
        self.received = 0
        self.resumed = 0
        _recover_swap(root)

    @property
    def incoming(self) -> Path:
        return self.root / "incoming"

    @property
    def part(self) -> Path:
        return self.incoming / "data.part"

    def _local_tensors(self, wanted: Callable[[str], bool]) -> list[dict[str, StoredTensor]]:
        found = []
        for source in (self.root / "current", self.configured):
            if source is not None and source.is_dir():
                try:
                    found.append(stored_tensors(source, wanted, self.cache_dir))
                except ConfigurationError as exc:
                    log.warning("prepare: ignoring %s: %s", source, exc)
        return found

    def check(self, manifest: PrepareManifest) -> tuple[PrepareState, list[str]]:
        """Which of the manifest's tensors this node lacks, and what an earlier try left."""
        names = {r.name for r in manifest.records}
        best: dict[str, StoredTensor] = {}
        expected = {r.name: r for r in manifest.records}
        for held in self._local_tensors(names.__contains__):
            for name, stored in held.items():
                if name not in best or stored.record == expected[name]:
                    best[name] = stored
        found: Triage = triage(manifest.records, {n: s.record for n, s in best.items()})
        overall = found.state
        self._local_files, self._needed_files = {}, []
        for record in manifest.files:
            found_file, path = find_local(record, (self.root / "current", self.configured))
            if path is not None:
                self._local_files[record.name] = path
                continue
            self._needed_files.append(record)
            if overall != "mismatch":
                overall = found_file
        self._manifest = manifest
        self._local = {n: best[n] for n in found.present}
        self._needed = [expected[n] for n in found.needed]
        self._total = sum(r.nbytes for r in self._needed) + sum(
            f.nbytes for f in self._needed_files
        )
        self.received = 0
        self.resumed = self._resume_point()
        state = PrepareState(
            state=overall,
            present=len(found.present),
            missing=len(found.missing),
            mismatched=len(found.mismatched),
            needed_bytes=self._total,
            have_bytes=self.resumed,
            files=[f.name for f in self._needed_files],
        )
        return state, [r.name for r in self._needed]

    @property
    def _streaming(self) -> bool:
        return bool(self._needed or self._needed_files)

    def _resume_point(self) -> int:
        """Bytes of this same plan already in data.part; a different plan starts over."""
        plan = {
            "tensors": [r.model_dump() for r in self._needed],
            "files": [f.model_dump() for f in self._needed_files],
        }
        plan_file = self.incoming / "plan.json"
        try:
            same = json.loads(plan_file.read_text()) == plan
        except (OSError, ValueError):
            same = False
        if same and self.part.is_file():
            have = min(self.part.stat().st_size, self._total)
            with self.part.open("r+b") as f:
                f.truncate(have)
            return have
        shutil.rmtree(self.incoming, ignore_errors=True)
        if not self._streaming:
            return 0
        self.incoming.mkdir(parents=True, exist_ok=True)
        _write_atomic(plan_file, json.dumps(plan).encode())
        self.part.write_bytes(b"")
        return 0

    def write(self, offset: int, data: bytes) -> None:
        """Append ``data``, which the sender placed at ``offset`` of the planned stream."""
        if self._manifest is None:
            raise ValueError("data before a prepare check")
        if len(data) > MAX_CHUNK_BYTES:
            raise ValueError(f"a chunk of {len(data)} bytes; at most {MAX_CHUNK_BYTES}")
        size = self.part.stat().st_size
        if offset != size or offset + len(data) > self._total:
            raise ValueError(
                f"data at offset {offset} (+{len(data)} bytes); expected {size}, "
                f"stream of {self._total}"
            )
        with self.part.open("ab") as f:
            f.write(data)
        self.received += len(data)

    def commit(self) -> PrepareResult:
        """Verify what arrived, build the copy, hash it from disk, and only then install it."""
        manifest = self._manifest
        if manifest is None:
            raise ValueError("commit before a prepare check")
        try:
            offsets, file_offsets = self._verify_received()
            copy, records = self._install(manifest, offsets, file_offsets)
        except (TransferError, ConfigurationError) as exc:
            log.error("prepare: %s", exc)
            return PrepareResult(ok=False, error=str(exc)[:600])
        shutil.rmtree(self.incoming, ignore_errors=True)
        self._manifest = None
        identity = identity_of(records, manifest.config, manifest.layers)
        log.info(
            "prepare: installed %d tensors and %d files (%d and %d received, %.1f MB) at %s; "
            "sha256 %s", identity.tensors, len(manifest.files), len(offsets), len(file_offsets),
            self._total / 1e6, copy, identity.short(),
        )  # fmt: skip
        if self.on_installed is not None:
            self.on_installed(identity)
        return PrepareResult(ok=True, identity=identity, verified_bytes=identity.nbytes)

    def _verify_received(self) -> tuple[dict[str, int], dict[str, int]]:
        """Each received tensor's and each received file's offset in data.part, after checking
        its SHA-256 (apart: a tensor and a file may share a name)."""
        size = self.part.stat().st_size if self._streaming else 0
        if size != self._total:
            raise TransferError(f"{size} of {self._total} bytes arrived; run prepare again")
        offsets: dict[str, int] = {}
        file_offsets: dict[str, int] = {}
        at = 0
        for record in self._needed:
            got = hash_range(self.part, at, record.nbytes).hexdigest()
            if got != record.sha256:
                with self.part.open("r+b") as f:
                    f.truncate(at)  # keep the verified bytes before it for the next try
                raise TransferError(
                    f"tensor {escape(record.name)} arrived with sha256 {got[:16]}, the cluster's "
                    f"record says {record.sha256[:16]}; it was discarded and nothing was installed"
                )
            offsets[record.name] = at
            at += record.nbytes
        for file in self._needed_files:
            got = sha256_of(self.part, at, file.nbytes)
            if got != file.sha256:
                with self.part.open("r+b") as f:
                    f.truncate(at)
                raise TransferError(
                    f"file {escape(file.name)} arrived with sha256 {got[:16]}, the cluster's "
                    f"record says {file.sha256[:16]}; it was discarded and nothing was installed"
                )
            file_offsets[file.name] = at
            at += file.nbytes
        return offsets, file_offsets

    def _install(
        self, manifest: PrepareManifest, received: dict[str, int], files: dict[str, int]
    ) -> tuple[Path, list[TensorRecord]]:
        """Build the copy beside ``current/``, check it from disk, then swap it in; on any
        failure before the swap the building directory goes and ``current/`` is untouched."""
        building = self.root / f"{_BUILDING}{os.getpid()}"
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir(parents=True)
        try:
            records = self._build(building, manifest, received)
            self._build_files(building, manifest, files)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
        current = self.root / "current"
        _swap_in(building, current, self.root / f"{_OLD}{os.getpid()}")
        return current, records

    def _build(
        self, building: Path, manifest: PrepareManifest, received: dict[str, int]
    ) -> list[TensorRecord]:
        sources: list[tuple[TensorRecord, Path, int]] = []
        for record in sorted(manifest.records, key=lambda r: r.name):
            if record.name in received:
                sources.append((record, self.part, received[record.name]))
            elif record.name in self._local:
                local = self._local[record.name]
                sources.append((record, local.path, local.offset))
            else:
                raise TransferError(f"tensor {escape(record.name)} was neither held nor received")
        _write_safetensors(building / "model.safetensors", sources)
        _write_atomic(building / "config.json", json.dumps(manifest.config, indent=2).encode())
        description = {
            "layers": list(manifest.layers),
            "stage": manifest.stage,
            "num_stages": manifest.num_stages,
            "records": [r.model_dump() for r in manifest.records],
            "files": [f.model_dump() for f in manifest.files],  # what was installed beside
        }
        _write_atomic(building / "prepared.json", json.dumps(description).encode())
        # What a stage would read: exactly the manifest's tensors, each as verified.
        on_disk = stored_tensors(building, lambda _n: True, None)
        wanted = {r.name: r for r in manifest.records}
        for name, record in wanted.items():
            stored = on_disk.get(name)
            if stored is None or stored.record != record:
                raise TransferError(
                    f"tensor {escape(name)} did not read back as verified from the copy built "
                    "for it; nothing was installed and the copy already here is unchanged"
                )
        if len(on_disk) != len(manifest.records):
            raise TransferError(
                f"the copy built holds {len(on_disk)} tensors, the manifest lists "
                f"{len(manifest.records)}; nothing was installed and the copy already here is "
                "unchanged"
            )
        return [s.record for s in on_disk.values()]

    def _build_files(
        self, building: Path, manifest: PrepareManifest, received: dict[str, int]
    ) -> None:
        """The manifest's files beside config.json, each read back against its record (the
        names passed ``MODEL_FILES`` at the edge: plain names, none a path)."""
        for record in manifest.files:
            target = building / record.name
            at = received.get(record.name)
            if at is not None:
                copy_bytes(self.part, at, record.nbytes, target)
            elif record.name in self._local_files:
                copy_bytes(self._local_files[record.name], 0, record.nbytes, target)
            else:
                raise TransferError(f"file {escape(record.name)} was neither held nor received")
            if target.stat().st_size != record.nbytes or sha256_of(target) != record.sha256:
                raise TransferError(
                    f"file {escape(record.name)} did not read back as verified from the copy "
                    "built for it; nothing was installed and the copy already here is unchanged"
                )


_BUILDING, _OLD = ".install-", ".old-"


def _swap_in(building: Path, current: Path, old: Path) -> None:
    """Rename ``building`` to ``current``; the copy it replaces is put back if that fails."""
    shutil.rmtree(old, ignore_errors=True)
    had = current.exists()
    if had:
        os.replace(current, old)
    try:
        os.replace(building, current)
    except BaseException:
        if had:
            os.replace(old, current)
        shutil.rmtree(building, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _recover_swap(root: Path) -> None:
    """A process killed between the two renames of ``_swap_in`` left no ``current/``: the copy
    it was replacing is put back (the new one was not installed yet)."""
    current = root / "current"
    if current.exists() or not root.is_dir():
        return
    for old in sorted(root.glob(f"{_OLD}*")):
        if (old / "prepared.json").is_file():
            os.replace(old, current)
            log.warning(
                "prepare: restored the installed copy from %s (an install was cut off)", old
            )
            return


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_safetensors(path: Path, sources: list[tuple[TensorRecord, Path, int]]) -> None:
    """A safetensors file holding exactly ``sources``' bytes, in order."""
    header: dict[str, Any] = {}
    at = 0
    for record, _, _ in sources:
        header[record.name] = {
            "dtype": record.dtype,
            "shape": record.shape,
            "data_offsets": [at, at + record.nbytes],
        }
        at += record.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writers do
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for record, source, offset in sources:
            try:
                copy_range(source, offset, record.nbytes, out)
            except ShortSource:
                raise TransferError(f"{source} ends inside tensor {record.name}") from None
        out.flush()
        os.fsync(out.fileno())
