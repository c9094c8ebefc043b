"""Shipping a stage's tensors to a node over the cluster transport (``mlxppctl prepare``'s
engine): a real stage worker that holds no model listens on loopback; a real sender ships it
from a tiny checkpoint. Only the stage's tensors travel, an interrupted send resumes without a
byte sent twice, and bytes that do not match the cluster's digests are never installed or
loaded. The tokenizer files travel too (the last stage compiles grammars against them), under
the same digests, and only by the plain names a prepared copy carries."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxppd.core.config.cluster import Node, NodeRole
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.kv_admission import UNLIMITED_BYTES, StageKvManager
from mlxppd.core.protocol.model_transfer import FileRecord, PrepareManifest, PrepareResult
from mlxppd.core.stages import StageSpec
from mlxppd.engine.prepared_copy import ModelReceiver, prepared_root, stage_model_dir
from mlxppd.engine.stage import load_stage
from mlxppd.engine.stage_digest import iter_chunks, stage_identity
from mlxppd.runtime.coordinator.model_sender import (
    ShipProgress,
    files_for,
    manifest_for,
    ship_stage,
)
from mlxppd.runtime.stage.worker import StageWorker
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.backends import create_transport
from tests.conftest import TINY_LLAMA
from tests.support.prepared_copies import crafted, renamed
from tests.support.wire import config, run

SPLIT = (StageSpec(0, 2, 0, 3), StageSpec(1, 2, 3, 6))
NODE = Node(id="stage-1", address="127.0.0.1:1", role=NodeRole.PIPELINE_STAGE, stage=1)


def model_config(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


class EmptyNode:
    """A stage worker holding no model, as an agent runs one on a host with none."""

    def __init__(self, cache: Path, configured: Path | None = None) -> None:
        self.receiver = ModelReceiver(prepared_root(cache, "tiny"), configured, cache)
        self.mlx = MlxThread("mlx-test-prepare")
        kv = StageKvManager(-1, UNLIMITED_BYTES, 0, 1)
        self.worker = StageWorker(
            StageSpec.standby(2), None, kv, create_transport("tcp", config("stage-1")), self.mlx,
            receiver=self.receiver, missing_model="no model files here",
        )  # fmt: skip

    async def __aenter__(self) -> Node:
        host, port = await self.worker.start("127.0.0.1", 0)
        return NODE.model_copy(update={"address": f"{host}:{port}"})

    async def __aexit__(self, *exc: object) -> None:
        await self.worker.close()
        self.mlx.close()


async def ship(
    node: Node, source: Path, spec: StageSpec, progress: ShipProgress, **kw: Any
) -> PrepareResult | None:
    manifest, tensors = manifest_for(source, spec, model_config(source), "tiny")
    sender = create_transport("tcp", config("coordinator"))
    files = files_for(source, manifest)
    return await ship_stage(sender, node, manifest, tensors, progress, files=files, **kw)


def test_an_empty_node_gets_exactly_its_stages_tensors(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    source = tiny_model("prepare-llama", TINY_LLAMA)
    spec = SPLIT[1]
    progress = ShipProgress("stage-1", 1, (3, 6))

    async def scenario() -> None:
        async with EmptyNode(tmp_path / "cache") as node:
            result = await ship(node, source, spec, progress)
            assert result is not None and result.ok
            # A second prepare finds everything present and sends nothing.
            again = ShipProgress("stage-1", 1, (3, 6))
            assert await ship(node, source, spec, again) is None
            assert again.found == "present" and again.bytes_sent == 0

    run(scenario)
    config_ = model_config(source)
    whole = sum(t.record.nbytes for t in stage_identity_parts(source, config_))
    assert progress.found == "missing" and progress.bytes_sent == progress.bytes_total
    assert progress.bytes_sent == stage_identity(source, spec, config_).nbytes < whole
    copy = stage_model_dir(None, prepared_root(tmp_path / "cache", "tiny"), spec, config_)
    assert stage_identity(copy, spec, config_) == stage_identity(source, spec, config_)
    # The copy loads and computes what the source's stage computes.
    x = mx.random.normal((1, 4, 64))
    want = load_stage(source, spec, config_)
    got = load_stage(copy, spec, config_)
    assert mx.allclose(want.net(x, want.net.make_cache()), got.net(x, got.net.make_cache()))


def stage_identity_parts(source: Path, config_: dict) -> list:
    from mlxppd.engine.stage_digest import stored_tensors

    return list(stored_tensors(source, lambda _n: True).values())


def test_an_interrupted_send_resumes_without_sending_a_byte_twice(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    source = tiny_model("prepare-llama", TINY_LLAMA)
    spec = SPLIT[1]
    first, second = ShipProgress("stage-1", 1, (3, 6)), ShipProgress("stage-1", 1, (3, 6))
    holder = EmptyNode(tmp_path / "cache")

    async def scenario() -> None:
        async with holder as node:
            slow = asyncio.ensure_future(
                ship(node, source, spec, first, chunk_bytes=4096, max_rate_bytes_s=200_000)
            )
            while not first.bytes_total or first.bytes_sent < first.bytes_total // 2:
                await asyncio.sleep(0.01)
            slow.cancel()  # the operator's ^C, a dropped link: the node keeps what arrived
            with pytest.raises(asyncio.CancelledError):
                await slow
            while holder.receiver.received < first.bytes_sent:
                await asyncio.sleep(0.01)
            result = await ship(node, source, spec, second, chunk_bytes=4096)
            assert result is not None and result.ok

    run(scenario)
    assert 0 < second.bytes_resumed == first.bytes_sent < second.bytes_total
    assert first.bytes_sent + second.bytes_sent == second.bytes_total


def test_tampered_bytes_are_refused_and_nothing_is_installed(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    source = tiny_model("prepare-llama", TINY_LLAMA)
    spec = SPLIT[1]
    manifest, tensors = manifest_for(source, spec, model_config(source), "tiny")
    receiver = ModelReceiver(prepared_root(tmp_path, "tiny"), None, tmp_path)
    state, names = receiver.check(manifest)
    assert state.state == "missing"
    stream = b"".join(b"".join(iter_chunks(tensors[n])) for n in names)
    flipped = bytearray(stream)
    flipped[len(stream) // 2] ^= 0x40  # one bit, somewhere in the middle
    receiver.write(0, bytes(flipped))
    result = receiver.commit()
    assert (
        not result.ok and "sha256" in (result.error or "") and "discarded" in (result.error or "")
    )
    assert not (receiver.root / "current").exists()
    # The verified tensors before the bad one stay for the next try; the rest goes.
    state, _ = receiver.check(manifest)
    assert 0 < state.have_bytes < len(stream) // 2 + 1
    receiver.write(state.have_bytes, stream[state.have_bytes :])
    assert receiver.commit().ok


def test_a_tampered_installed_copy_is_never_loaded(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    source = tiny_model("prepare-llama", TINY_LLAMA)
    spec = SPLIT[1]
    config_ = model_config(source)
    manifest, tensors = manifest_for(source, spec, config_, "tiny")
    receiver = ModelReceiver(prepared_root(tmp_path, "tiny"), None, tmp_path)
    _, names = receiver.check(manifest)
    receiver.write(0, b"".join(b"".join(iter_chunks(tensors[n])) for n in names))
    assert receiver.commit().ok
    installed = receiver.root / "current" / "model.safetensors"
    data = bytearray(installed.read_bytes())
    data[-10] ^= 0x01
    installed.write_bytes(bytes(data))
    with pytest.raises(ConfigurationError, match="no longer matches the digest"):
        stage_model_dir(None, receiver.root, spec, config_, tmp_path)


def test_a_node_with_one_wrong_tensor_receives_only_that_tensor(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    source = tiny_model("prepare-llama", TINY_LLAMA)
    spec = SPLIT[1]
    config_ = model_config(source)
    wrong = tmp_path / "wrong"
    shutil.copytree(source, wrong)
    weights = mx.load(str(wrong / "model.safetensors"))
    assert isinstance(weights, dict)
    name = "model.layers.4.mlp.down_proj.weight"
    weights[name] = weights[name] + 1e-3
    mx.save_safetensors(str(wrong / "model.safetensors"), weights)
    manifest, tensors = manifest_for(source, spec, config_, "tiny")
    receiver = ModelReceiver(prepared_root(tmp_path / "cache", "tiny"), wrong, tmp_path)
    state, names = receiver.check(manifest)
    assert (state.state, names) == ("mismatch", [name])
    assert state.needed_bytes == tensors[name].record.nbytes
    receiver.write(0, b"".join(iter_chunks(tensors[name])))
    assert receiver.commit().ok
    copy = stage_model_dir(wrong, receiver.root, spec, config_)
    assert copy == receiver.root / "current"
    assert stage_identity(copy, spec, config_) == stage_identity(source, spec, config_)


# -- a manifest that must not replace the installed copy --------------------------------------


def assert_serves_the_clusters_copy(root: Path, source: Path, spec: StageSpec) -> None:
    """The installed copy is the one verified before, and a stage loads and computes from it."""
    config_ = model_config(source)
    copy = stage_model_dir(None, root, spec, config_)
    assert copy == root / "current"
    assert stage_identity(copy, spec, config_) == stage_identity(source, spec, config_)
    assert not [p.name for p in root.iterdir() if p.name.startswith((".install-", ".old-"))]
    x = mx.random.normal((1, 4, 64))
    want, got = load_stage(source, spec, config_), load_stage(copy, spec, config_)
    assert mx.allclose(want.net(x, want.net.make_cache()), got.net(x, got.net.make_cache()))


Q_PROJ, O_PROJ = "model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.o_proj.weight"


def test_a_copy_that_does_not_read_back_as_its_manifest_leaves_the_installed_copy_as_it_was(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """Past the edge's checks (a manifest built without them), the receiver still installs
    nothing it has not read back from disk: a tensor listed twice builds a file holding one
    fewer, which is refused before the swap, and the copy verified earlier stays in place."""
    source = tiny_model("prepare-llama", TINY_LLAMA)
    spec = SPLIT[1]
    manifest, tensors = manifest_for(source, spec, model_config(source), "tiny")
    receiver = ModelReceiver(prepared_root(tmp_path, "tiny"), None, tmp_path)
    _, names = receiver.check(manifest)
    receiver.write(0, b"".join(b"".join(iter_chunks(tensors[n])) for n in names))
    assert receiver.commit().ok
    # q_proj again, with o_proj's digest and bytes: the received bytes verify, the copy cannot.
    bad, bad_tensors = crafted(manifest, tensors, renamed(tensors, O_PROJ, Q_PROJ), O_PROJ)
    _, names = receiver.check(bad)
    assert names == [Q_PROJ]
    receiver.write(0, b"".join(iter_chunks(bad_tensors[Q_PROJ])))
    result = receiver.commit()
    assert not result.ok
    assert_serves_the_clusters_copy(receiver.root, source, spec)
    assert "nothing was installed and the copy already here is unchanged" in (result.error or "")


def test_a_manifest_naming_a_tensor_twice_or_metadata_is_refused_and_the_node_keeps_its_copy(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """Over the wire to a real stage worker: each bad manifest fails its prepare alone, with a
    sentence naming the field (no traceback, the channel answers); the copy verified before
    stays loadable, and a normal prepare afterwards finds it complete."""
    source = tiny_model("prepare-llama", TINY_LLAMA)
    spec = SPLIT[1]
    manifest, tensors = manifest_for(source, spec, model_config(source), "tiny")
    attacks = {
        "is listed twice": crafted(manifest, tensors, renamed(tensors, O_PROJ, Q_PROJ), O_PROJ),
        "is the key safetensors reserves": crafted(
            manifest, tensors, renamed(tensors, O_PROJ, "__metadata__"), O_PROJ
        ),
    }
    refusals: dict[str, str] = {}

    async def scenario() -> None:
        async with EmptyNode(tmp_path / "cache") as node:
            assert await ship(node, source, spec, ShipProgress("stage-1", 1, (3, 6))) is not None
            for says, (bad, bad_tensors) in attacks.items():
                sender = create_transport("tcp", config("coordinator"))
                progress = ShipProgress("stage-1", 1, (3, 6))
                with pytest.raises(RuntimeError, match="refused the prepare") as refused:
                    await ship_stage(sender, node, bad, bad_tensors, progress)
                refusals[says] = str(refused.value)
                again = ShipProgress("stage-1", 1, (3, 6))
                assert await ship(node, source, spec, again) is None  # a normal prepare
                assert again.found == "present" and again.bytes_sent == 0

    run(scenario)
    for says, message in refusals.items():
        assert re.search(r"records\[\d+\]\.name: '[^']+' " + says, message), message
    assert_serves_the_clusters_copy(prepared_root(tmp_path / "cache", "tiny"), source, spec)


def test_an_install_cut_off_between_its_two_renames_gets_the_installed_copy_back(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """Killed after ``current/`` was moved aside and before the new copy took its place: the
    next receiver (the agent's restart) puts the old copy back rather than serving none."""
    source = tiny_model("prepare-llama", TINY_LLAMA)
    spec = SPLIT[1]
    manifest, tensors = manifest_for(source, spec, model_config(source), "tiny")
    receiver = ModelReceiver(prepared_root(tmp_path, "tiny"), None, tmp_path)
    _, names = receiver.check(manifest)
    receiver.write(0, b"".join(b"".join(iter_chunks(tensors[n])) for n in names))
    assert receiver.commit().ok
    (receiver.root / "current").rename(receiver.root / ".old-4242")
    ModelReceiver(receiver.root, None, tmp_path)
    assert_serves_the_clusters_copy(receiver.root, source, spec)


# -- the tokenizer files --------------------------------------------------------------------

#: what a model directory holds beside its weights: the first three a prepared copy carries
TOKENIZER_FILES = {
    "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE", "vocab": {}}}' * 300,
    "tokenizer_config.json": b'{"eos_token": "</s>", "chat_template": "{{ messages }}"}',
    "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
    "README.md": b"not part of any stage",
}
CARRIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def with_tokenizer(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    for name, data in TOKENIZER_FILES.items():
        (target / name).write_bytes(data)
    return target


def stream_of(manifest: PrepareManifest, names: list[str], files: list[str], source: Path) -> bytes:
    """The bytes a sender streams for the receiver's plan: the tensors, then the files."""
    _, tensors = manifest_for(source, SPLIT[1], model_config(source), "tiny")
    data = b"".join(b"".join(iter_chunks(tensors[n])) for n in names)
    return data + b"".join((source / f).read_bytes() for f in files)


def test_the_copy_holds_the_tokenizer_files_byte_identical_and_a_second_prepare_ships_none(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    source = with_tokenizer(tiny_model("prepare-llama", TINY_LLAMA), tmp_path / "source")
    progress, again = ShipProgress("stage-1", 1, (3, 6)), ShipProgress("stage-1", 1, (3, 6))

    async def scenario() -> None:
        async with EmptyNode(tmp_path / "cache") as node:
            result = await ship(node, source, SPLIT[1], progress)
            assert result is not None and result.ok
            assert await ship(node, source, SPLIT[1], again) is None

    run(scenario)
    copy = prepared_root(tmp_path / "cache", "tiny") / "current"
    for name in CARRIED:
        assert (copy / name).read_bytes() == (source / name).read_bytes()
    assert not (copy / "README.md").exists()  # only the names a prepared copy carries
    files = sum(len(TOKENIZER_FILES[n]) for n in CARRIED)
    tensors = stage_identity(source, SPLIT[1], model_config(source)).nbytes
    assert progress.bytes_sent == progress.bytes_total == progress.stage_bytes == tensors + files
    assert (again.found, again.bytes_sent) == ("present", 0)


def test_a_copy_without_the_tokenizer_files_is_sent_only_them(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """A copy installed before the files travelled: the next prepare sends no tensor."""
    bare = tiny_model("prepare-llama", TINY_LLAMA)
    source = with_tokenizer(bare, tmp_path / "source")
    later = ShipProgress("stage-1", 1, (3, 6))

    async def scenario() -> None:
        async with EmptyNode(tmp_path / "cache") as node:
            assert await ship(node, bare, SPLIT[1], ShipProgress("stage-1", 1, (3, 6)))
            result = await ship(node, source, SPLIT[1], later)
            assert result is not None and result.ok

    run(scenario)
    assert (later.found, later.tensors_needed) == ("missing", 0)
    assert later.bytes_sent == sum(len(TOKENIZER_FILES[n]) for n in CARRIED)
    copy = prepared_root(tmp_path / "cache", "tiny") / "current"
    assert (copy / "tokenizer.json").read_bytes() == TOKENIZER_FILES["tokenizer.json"]


def test_a_tampered_tokenizer_file_is_refused_and_nothing_is_installed(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    source = with_tokenizer(tiny_model("prepare-llama", TINY_LLAMA), tmp_path / "source")
    manifest, _ = manifest_for(source, SPLIT[1], model_config(source), "tiny")
    receiver = ModelReceiver(prepared_root(tmp_path, "tiny"), None, tmp_path)
    state, names = receiver.check(manifest)
    assert state.files == list(CARRIED)
    stream = stream_of(manifest, names, state.files, source)
    flipped = bytearray(stream)
    flipped[-len(TOKENIZER_FILES["chat_template.jinja"]) - 10] ^= 0x01  # in tokenizer_config
    receiver.write(0, bytes(flipped))
    result = receiver.commit()
    assert not result.ok
    assert "file tokenizer_config.json arrived with sha256" in (result.error or "")
    assert "discarded and nothing was installed" in (result.error or "")
    assert not (receiver.root / "current").exists()
    # The tensors and the file verified before it stay; the next try sends the rest.
    state, _ = receiver.check(manifest)
    assert state.have_bytes == len(stream) - sum(len(TOKENIZER_FILES[n]) for n in CARRIED[1:])
    receiver.write(state.have_bytes, stream[state.have_bytes :])
    assert receiver.commit().ok
    assert (receiver.root / "current" / "tokenizer_config.json").read_bytes() == (
        TOKENIZER_FILES["tokenizer_config.json"]
    )


def test_a_manifest_naming_a_path_or_an_unlisted_file_is_refused_and_the_node_keeps_its_copy(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """Over the wire, from a sender that skips the edge's checks: a file named '../x', 'a/b'
    or one no prepared copy carries fails that prepare alone, naming the field; nothing is
    written outside the copy and the copy installed before still serves."""
    source = with_tokenizer(tiny_model("prepare-llama", TINY_LLAMA), tmp_path / "source")
    spec = SPLIT[1]
    manifest, tensors = manifest_for(source, spec, model_config(source), "tiny")
    data = source / "tokenizer.json"
    held = files_for(source, manifest)["tokenizer.json"]
    says = {
        "../x": "is a path",
        "a/b": "is a path",
        "README.md": "is not one of the files a prepared copy carries",
    }
    refusals: dict[str, str] = {}

    async def scenario() -> None:
        async with EmptyNode(tmp_path / "cache") as node:
            assert await ship(node, source, spec, ShipProgress("stage-1", 1, (3, 6)))
            for name in says:
                record = FileRecord.model_construct(**{**dict(held.record), "name": name})
                bad = PrepareManifest.model_construct(
                    **{**dict(manifest), "files": [*manifest.files, record]}
                )
                files = {**files_for(source, manifest), name: type(held)(record, data)}
                sender = create_transport("tcp", config("coordinator"))
                with pytest.raises(RuntimeError, match="refused the prepare") as refused:
                    await ship_stage(
                        sender, node, bad, tensors, ShipProgress("stage-1", 1, (3, 6)),
                        files=files,
                    )  # fmt: skip
                refusals[name] = str(refused.value)

    run(scenario)
    for name, clause in says.items():
        assert re.search(rf"files\[3\]\.name: '{re.escape(name)}' {clause}", refusals[name])
    root = prepared_root(tmp_path / "cache", "tiny")
    assert not (root / "x").exists() and not (root / "current" / "a").exists()
    assert not (root / "current" / "README.md").exists()
    assert_serves_the_clusters_copy(root, source, spec)
