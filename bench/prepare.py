"""What ``mlxppctl prepare`` ships and how fast, against a raw loopback socket, in one run.

    .venv/bin/python bench/prepare.py [--model DIR] [--stages 2,3]

For each split of the model into k stages and each stage: the bytes that stage is sent (only
its layers' tensors, plus the embedding or head it owns, and the tokenizer files) against the
whole checkpoint, and the time to ship them to an empty node. The node is a real stage worker
holding no model in its own process (a real agent's, with its model cache in a temporary
directory): the sender reads the tensors from the checkpoint, the bytes travel over the
authenticated, encrypted transport, and the node writes, hashes every tensor and file against
the cluster's record and installs the copy.

Baseline, same run, same bytes: a raw, unencrypted loopback TCP socket into a process that
writes what it receives to a file (no hashing, no install). The ratio is what verification,
encryption and the install cost; both sides read and write the same disk.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlxppd.core.config.cluster import Node, NodeRole
from mlxppd.core.config.roster import Roster
from mlxppd.core.kv_admission import UNLIMITED_BYTES, StageKvManager
from mlxppd.core.layer_ranges import even_split
from mlxppd.core.stages import StageSpec
from mlxppd.engine.embedded import default_cache_dir, ensure_embedded_model
from mlxppd.engine.prepared_copy import ModelReceiver, prepared_root
from mlxppd.engine.stage_digest import iter_chunks, stored_tensors
from mlxppd.runtime.coordinator.model_sender import (
    ShipProgress,
    files_for,
    manifest_for,
    ship_stage,
)
from mlxppd.runtime.stage.worker import StageWorker
from mlxppd.runtime.system import event_loop
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.backends import create_transport
from mlxppd.wire.node_key import NodeKey
from mlxppd.wire.roster_book import RosterBook
from mlxppd.wire.secret import ClusterSecret
from mlxppd.wire.transport import WireConfig

SECRET = ClusterSecret(os.urandom(32), "bench")
MB = 1e6


NODES = ("coordinator", "node")


def node_key(node_id: str, secret: ClusterSecret) -> NodeKey:
    """``node_id``'s key, derived from the run's fresh secret: the receiver process, handed
    only the secret, holds the same keys (the roster) as the sender."""
    raw = hashlib.sha256(secret.key_bytes() + b"\x00node key\x00" + node_id.encode()).digest()
    return NodeKey.from_private_bytes(raw, f"bench key of {node_id}")


def wire(node_id: str, secret: ClusterSecret) -> WireConfig:
    roster = Roster.of({n: node_key(n, secret).public for n in NODES})
    return WireConfig("bench", node_id, secret, node_key(node_id, secret), RosterBook(roster))


async def _receiver(port_file: Path, cache: Path, key: bytes) -> None:
    receiver = ModelReceiver(prepared_root(cache, "bench"), None, cache)
    mlx = MlxThread("bench-receiver")
    worker = StageWorker(
        StageSpec.standby(2), None, StageKvManager(-1, UNLIMITED_BYTES, 0, 1),
        create_transport("tcp", wire("node", ClusterSecret(key, "bench"))), mlx,
        receiver=receiver, missing_model="bench",
    )  # fmt: skip
    _, port = await worker.start("127.0.0.1", 0)
    port_file.write_text(str(port))
    await asyncio.Event().wait()


def _raw_receiver(port_file: Path, out: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port_file.write_text(str(server.getsockname()[1]))
        conn, _ = server.accept()
        buf = bytearray(1 << 20)
        with conn, out.open("wb") as f:
            while n := conn.recv_into(buf):
                f.write(memoryview(buf)[:n])
            f.flush()
            os.fsync(f.fileno())
            conn.sendall(b"k")  # the ack: every byte is on disk


def _spawn(*args: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    work = Path(tempfile.mkdtemp(prefix="mlxpp-bench-prepare-"))
    port_file = work / "port"
    proc = subprocess.Popen([sys.executable, __file__, *args, str(port_file), str(work)])
    while not port_file.exists() or not port_file.read_text():
        if proc.poll() is not None:
            raise SystemExit(f"the receiver exited with {proc.returncode}")
        time.sleep(0.05)
    return proc, int(port_file.read_text()), work


def raw_seconds(chunks: list[bytes]) -> float:
    proc, port, _ = _spawn("--raw-receiver")
    try:
        started = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for chunk in chunks:
                sock.sendall(chunk)
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1)
        return time.perf_counter() - started
    finally:
        proc.kill()


def prepare_seconds(model: Path, spec: StageSpec, config: dict) -> tuple[float, int]:
    proc, port, _ = _spawn("--receiver", SECRET.key_bytes().hex())
    try:
        manifest, tensors = manifest_for(model, spec, config, "bench")
        node = Node(id="node", address=f"127.0.0.1:{port}", role=NodeRole.PIPELINE_STAGE, stage=1)
        progress = ShipProgress("node", spec.index, (spec.start, spec.end))

        async def ship() -> None:
            sender = create_transport("tcp", wire("coordinator", SECRET))
            files = files_for(model, manifest)
            result = await ship_stage(sender, node, manifest, tensors, progress, files=files)
            assert result is not None and result.ok, result

        started = time.perf_counter()
        event_loop.run(ship())
        return time.perf_counter() - started, progress.bytes_sent
    finally:
        proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="mlx-lm directory (default: the embedded one)")
    parser.add_argument("--stages", default="2,3", help="stage counts to split into")
    args = parser.parse_args()
    model = args.model or ensure_embedded_model(default_cache_dir())
    config = json.loads((model / "config.json").read_text())
    everything = stored_tensors(model, lambda _n: True)
    whole = sum(t.record.nbytes for t in everything.values())
    layers = int(config["num_hidden_layers"])
    print(f"model {model.name}: {whole / MB:.1f} MB of tensors, {layers} layers\n")
    print("| k | stage | layers | shipped (MB) | of the model | raw socket (s) | prepare (s) "
          "| prepare (MB/s) | prepare / raw |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for k in (int(x) for x in args.stages.split(",")):
        for i, r in enumerate(even_split(layers, k)):
            spec = StageSpec(i, k, r.start, r.end)
            manifest, tensors = manifest_for(model, spec, config, "bench")
            chunks = [c for t in tensors.values() for c in iter_chunks(t)]
            # The tokenizer files travel too (a few MB): the raw socket sends them as well.
            chunks += [(model / f.name).read_bytes() for f in manifest.files]
            raw = raw_seconds(chunks)
            took, sent = prepare_seconds(model, spec, config)
            print(
                f"| {k} | {i} | {r.start}-{r.end - 1} | {sent / MB:.1f} | {sent / whole:.0%} "
                f"| {raw:.2f} | {took:.2f} | {sent / MB / took:.0f} | {took / raw:.1f}x |",
                flush=True,
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--receiver"]:
        key, port_file, work = sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
        event_loop.run(_receiver(port_file, work / "cache", bytes.fromhex(key)))
    elif sys.argv[1:2] == ["--raw-receiver"]:
        _raw_receiver(Path(sys.argv[2]), Path(sys.argv[3]) / "data")
    else:
        main()
