"""Prepared copies for tests: a node's copy with one tensor changed, and what a hostile peer
holding the cluster secret sends a stage instead of ``mlxppctl prepare``'s manifest (tensors
or model files named as none may be).

``python -m tests.support.prepared_copies ATTACK CONFIG_DIR MODEL_DIR HOST:PORT START END
[ADAPTER_DIR]`` runs one attack from a host of a test cluster (``ip netns exec``), as node
"coordinator" of the cluster TOML in CONFIG_DIR, against the stage at HOST:PORT serving layers
[START, END) of stage 1 of 2, and prints what the stage answered as one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from mlxppd.core.config.cluster import Node, NodeRole, load_cluster_config
from mlxppd.core.model_identity import TensorRecord
from mlxppd.core.protocol.adapters import AdapterLoad, AdapterReply
from mlxppd.core.protocol.model_transfer import FileRecord, PrepareManifest
from mlxppd.core.stages import StageSpec
from mlxppd.engine.prepared_files import HeldFile
from mlxppd.engine.stage_digest import StoredTensor
from mlxppd.runtime.coordinator.control_client import ControlClient
from mlxppd.runtime.coordinator.model_sender import (
    ShipProgress,
    files_for,
    manifest_for,
    ship_stage,
)
from mlxppd.wire.backends import create_transport, wire_config_for
from mlxppd.wire.node_key import load_node_key
from mlxppd.wire.secret import load_cluster_secret
from mlxppd.wire.transport import Transport

#: in stage 1's layers (15-29) of the embedded model
CHANGED = "model.layers.20.mlp.down_proj.scales"
#: two tensors of the same dtype and shape in stage 1's layers
Q_PROJ = "model.layers.20.self_attn.q_proj.weight"
O_PROJ = "model.layers.20.self_attn.o_proj.weight"


def one_tensor_changed(source: Path, target: Path) -> None:
    """A copy of ``source`` whose tensor ``CHANGED`` differs in value (same shape)."""
    import mlx.core as mx

    shutil.copytree(source, target)
    weights = mx.load(str(target / "model.safetensors"))
    assert isinstance(weights, dict)
    weights[CHANGED] = weights[CHANGED] * 1.5
    mx.save_safetensors(str(target / "model.safetensors"), weights, {"format": "mlx"})


def renamed(tensors: dict[str, StoredTensor], source: str, name: str) -> TensorRecord:
    return tensors[source].record.model_copy(update={"name": name})


def crafted(
    manifest: PrepareManifest, tensors: dict[str, StoredTensor], extra: TensorRecord, source: str
) -> tuple[PrepareManifest, dict[str, StoredTensor]]:
    """``manifest`` plus ``extra``, built as a hostile sender would (no validation), whose
    bytes are those of tensor ``source``: they verify against ``extra``'s digest."""
    bad = PrepareManifest.model_construct(
        **{**dict(manifest), "records": [*manifest.records, extra]}
    )
    held = tensors[source]
    return bad, {**tensors, extra.name: StoredTensor(extra, held.path, held.offset)}


#: model files named as no prepared copy's file may be: a path out, a path in, an unlisted name
FILE_ATTACKS = {"file-up": "../x", "file-dir": "a/b", "file-unlisted": "run.sh"}


def crafted_file(
    manifest: PrepareManifest, files: dict[str, HeldFile], name: str
) -> tuple[PrepareManifest, dict[str, HeldFile]]:
    """``manifest`` plus a file ``name`` (no validation) whose bytes and digest are those of
    tokenizer.json: they would verify, were the name taken."""
    held = files["tokenizer.json"]
    record = FileRecord.model_construct(**{**dict(held.record), "name": name})
    bad = PrepareManifest.model_construct(**{**dict(manifest), "files": [*manifest.files, record]})
    return bad, {**files, name: HeldFile(record, held.path)}


def hostile_manifest(
    attack: str, manifest: PrepareManifest, tensors: dict[str, StoredTensor]
) -> tuple[PrepareManifest, dict[str, StoredTensor]]:
    """The manifest of ``attack``: a tensor listed twice, or one named as no tensor may be."""
    name = {
        "twice": Q_PROJ,
        "metadata": "__metadata__",
        "path": "../../../etc/cron.d/x",
        "nul": "model.norm\x00.weight",
    }[attack]
    return crafted(manifest, tensors, renamed(tensors, O_PROJ, name), O_PROJ)


async def _adapter_load(transport: Transport, node: Node, path: str) -> AdapterReply:
    channel = await transport.connect(node.host, node.port, expected_peer=node.id)
    control = ControlClient(channel, 60.0)
    reader = asyncio.ensure_future(control.read_replies())
    try:
        return await control.ask(AdapterLoad(name="evil", path=path), AdapterReply)
    finally:
        await channel.close()
        reader.cancel()


async def attack(argv: list[str]) -> dict[str, Any]:
    name, config_dir, model_dir, address, start, end = argv[:6]
    config_path = Path(config_dir)
    cluster = load_cluster_config(config_path / "cluster.toml")
    secret = load_cluster_secret(
        config_secret_file=cluster.cluster.secret_file, config_dir=config_path
    )
    # The coordinator's own key, from its config directory: the hostile peer is that node.
    key = load_node_key("coordinator", config_dir=config_path)
    transport = create_transport("tcp", wire_config_for(cluster, "coordinator", secret, key))
    node = Node(id="stage-1", address=address, role=NodeRole.PIPELINE_STAGE, stage=1)
    if name == "adapter-link":
        reply = await _adapter_load(transport, node, argv[6])
        return {"ok": reply.ok, "error": reply.error}
    model = Path(model_dir)
    config = json.loads((model / "config.json").read_text())
    spec = StageSpec(1, 2, int(start), int(end))
    manifest, tensors = manifest_for(model, spec, config, model.name)
    files = files_for(model, manifest)
    if name in FILE_ATTACKS:
        bad, files = crafted_file(manifest, files, FILE_ATTACKS[name])
        bad_tensors = tensors
    else:
        bad, bad_tensors = hostile_manifest(name, manifest, tensors)
    progress = ShipProgress("stage-1", 1, (spec.start, spec.end))
    try:
        result = await ship_stage(transport, node, bad, bad_tensors, progress, files=files)
    except Exception as exc:  # what the stage answered, or how the channel ended
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": result is None or result.ok, "error": None if result is None else result.error}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(attack(sys.argv[1:]))))
