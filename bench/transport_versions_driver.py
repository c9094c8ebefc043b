"""The processes ``bench/transport_versions.py`` measures with: one driver per protocol version
and the peer (listener) it starts, both from that version's tree (PYTHONPATH).

    python bench/transport_versions_driver.py --driver TARGET [--backend tcp] [--rekey-after N]

A driver reads one JSON command per line on stdin (handshake, step, prefill, rekeys, quit) and
answers one JSON line on stdout; the timings are taken here, with ``perf_counter``. Only the
standard library and numpy at module level: either tree's mlxppd is imported inside functions,
with that tree's own API.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, cast

import numpy as np

# Only the standard library and numpy at module level: drivers of either tree import this file.
HERE = Path(__file__).resolve()
STEP_SHAPE, PREFILL_SHAPE = (1, 1, 4096), (1, 512, 4096)  # fp16: 8 KiB, 4 MiB
PREFILL_BYTES = 2 * int(np.prod(PREFILL_SHAPE))
MAX_FRAME = 16 * 1024 * 1024
ECHO, STREAM, STREAM_LAST, ACK = 0, 1, 2, 3
RAW_HEADER = struct.Struct("<II")  # payload length, mode
CLUSTER = "bench"
NODES = ("driver", "peer")


def node_key_bytes(secret_hex: str, node_id: str) -> bytes:
    """A throwaway X25519 private key for ``node_id``, derived from this run's random secret,
    so driver and peer can each build the roster without sending keys around."""
    return hashlib.sha256(f"bench node key {node_id} {secret_hex}".encode()).digest()


# -- raw: length-prefixed frames on the event loop --------------------------------------------


class RawProtocol(asyncio.BufferedProtocol):
    """Frames land by recv_into in one preallocated buffer; ``on_frame(mode)`` per frame."""

    def __init__(self, on_frame: Callable[[RawProtocol, int], None]):
        self.on_frame = on_frame
        self.buf = bytearray()  # allocated on the first byte: a bare connect costs no memset
        self.view = memoryview(self.buf)
        self.have = 0
        self.transport: asyncio.Transport | None = None
        self.can_write: asyncio.Future[None] | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = self.transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint: int) -> memoryview:
        if not self.buf:
            self.buf = bytearray(MAX_FRAME + RAW_HEADER.size)
            self.view = memoryview(self.buf)
        return self.view[self.have :]

    def buffer_updated(self, nbytes: int) -> None:
        self.have += nbytes
        while self.have >= RAW_HEADER.size:
            length, mode = RAW_HEADER.unpack_from(self.buf)
            end = RAW_HEADER.size + length
            if self.have < end:
                return
            self.on_frame(self, mode)
            self.view[: self.have - end] = self.view[end : self.have]
            self.have -= end

    def pause_writing(self) -> None:
        self.can_write = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.can_write is not None and not self.can_write.done():
            self.can_write.set_result(None)
        self.can_write = None

    async def send(self, mode: int, payload: memoryview | bytes = b"") -> None:
        assert self.transport is not None
        header = RAW_HEADER.pack(len(payload), mode)
        if len(payload) <= 65536:
            self.transport.writelines([header, payload])
        else:  # asyncio's writelines joins its buffers first: a copy a big frame need not pay
            self.transport.write(header)
            self.transport.write(payload)
        if self.can_write is not None:  # flow control, as a secure channel's send awaits it
            await self.can_write

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


# -- the peer: a listener that echoes decode steps and acks prefill rounds ----------------------


async def peer_main(target: str, backend: str, rekey_after: int) -> None:
    loop = asyncio.get_running_loop()
    echo = np.ones(STEP_SHAPE, dtype=np.float16)
    echo_bytes = echo.data.cast("B")
    if target == "raw":

        def on_frame(proto: RawProtocol, mode: int) -> None:
            assert proto.transport is not None
            if mode == ECHO:
                proto.transport.writelines([RAW_HEADER.pack(echo.nbytes, ECHO), echo_bytes])
            elif mode == STREAM_LAST:
                proto.transport.write(RAW_HEADER.pack(0, ACK))

        server = await loop.create_server(lambda: RawProtocol(on_frame), "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], 0, flush=True)
        await loop.run_in_executor(None, sys.stdin.read)  # until the driver goes
        server.close()
        return

    from mlxppd.wire.backends import create_transport
    from mlxppd.wire.codec import MessageKind
    from mlxppd.wire.errors import ChannelClosedError

    async def handler(channel: Any) -> None:
        buf = None  # allocated after the first message: a bare handshake costs no memset
        try:
            while True:
                mode = (await channel.recv(into=buf)).meta["m"]
                if buf is None:
                    buf = bytearray(MAX_FRAME)
                if mode == ECHO:
                    await channel.send(MessageKind.ACTIVATION, {"m": ECHO}, echo)
                elif mode == STREAM_LAST:
                    await channel.send(MessageKind.REPLY, {"m": ACK})
        except ChannelClosedError:
            pass

    main = await create_transport(backend, wire_config("peer")).listen("127.0.0.1", 0, handler)
    rekeying = None
    if supports_rekey():
        config = wire_config("peer", rekey_after=rekey_after)
        rekeying = await create_transport(backend, config).listen("127.0.0.1", 0, handler)
    print(main.address[1], rekeying.address[1] if rekeying else 0, flush=True)
    await loop.run_in_executor(None, sys.stdin.read)
    for listener in (main, rekeying):
        if listener is not None:
            await listener.close()


def supports_rekey() -> bool:
    from mlxppd.wire.transport import WireConfig

    return "rekey" in {f.name for f in fields(WireConfig)}


def wire_config(node_id: str, *, rekey_after: int | None = None) -> Any:
    """This tree's WireConfig, built with this tree's own API."""
    from mlxppd.wire.limits import FrameLimits
    from mlxppd.wire.secret import load_cluster_secret
    from mlxppd.wire.transport import WireConfig

    names = {f.name for f in fields(WireConfig)}
    settings: dict[str, Any] = dict(
        cluster_name=CLUSTER,
        node_id=node_id,
        secret=load_cluster_secret(environ=os.environ),  # MLXPP_CLUSTER_SECRET
        limits=FrameLimits(max_frame_bytes=MAX_FRAME),
        max_connections=1024,
    )
    if "node_key" in names:  # protocol 2: per-node keys and the roster that lists them
        from mlxppd.core.config.roster import Roster
        from mlxppd.wire.node_key import NodeKey
        from mlxppd.wire.roster_book import RosterBook

        secret = os.environ["MLXPP_CLUSTER_SECRET"]
        keys = {n: NodeKey.from_private_bytes(node_key_bytes(secret, n), "bench") for n in NODES}
        settings["node_key"] = keys[node_id]
        settings["roster"] = RosterBook(Roster.of({n: k.public for n, k in keys.items()}))
    if rekey_after is not None:
        from mlxppd.wire.channel import RekeyPolicy

        settings["rekey"] = RekeyPolicy(after_records=rekey_after)
    return WireConfig(**settings)


# -- the driver: runs the measurements the parent asks for, one block at a time -----------------


class RawClient:
    def __init__(self, port: int):
        self.port = port
        self.frames: asyncio.Queue[int] = asyncio.Queue()

    def _on_frame(self, proto: RawProtocol, mode: int) -> None:
        self.frames.put_nowait(mode)

    async def connect(self) -> RawProtocol:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(
            lambda: RawProtocol(self._on_frame), "127.0.0.1", self.port
        )
        return proto

    @staticmethod
    async def close(proto: RawProtocol) -> None:
        assert proto.transport is not None
        proto.transport.close()
        await proto.closed


class Driver:
    def __init__(self, target: str, backend: str, ports: tuple[int, int], rekey_after: int):
        self.target = target
        self.step = np.ones(STEP_SHAPE, dtype=np.float16)
        self.prefill = np.ones(PREFILL_SHAPE, dtype=np.float16)
        self.buf = bytearray(MAX_FRAME)
        self.channels: dict[str, Any] = {}
        self.ports = ports
        if target == "raw":
            self.raw = RawClient(ports[0])
            return
        from mlxppd.wire.backends import create_transport
        from mlxppd.wire.codec import MessageKind

        self.kind = MessageKind
        self.transport = create_transport(backend, wire_config("driver"))
        self.rekeying = None
        if ports[1]:
            config = wire_config("driver", rekey_after=rekey_after)
            self.rekeying = create_transport(backend, config)

    async def open(self) -> None:
        if self.target == "raw":
            self.channels["main"] = await self.raw.connect()
            return
        self.channels["main"] = await self.transport.connect("127.0.0.1", self.ports[0])
        if self.rekeying is not None:
            self.channels["rekey"] = await self.rekeying.connect("127.0.0.1", self.ports[1])

    async def handshakes(self, n: int) -> dict[str, Any]:
        out = []
        for _ in range(n):
            start = time.perf_counter_ns()
            if self.target == "raw":
                proto = await self.raw.connect()
                out.append(time.perf_counter_ns() - start)
                await self.raw.close(proto)
            else:
                channel = await self.transport.connect("127.0.0.1", self.ports[0])
                out.append(time.perf_counter_ns() - start)
                await channel.close()
        return {"ns": out}

    async def steps(self, n: int, channel_name: str) -> dict[str, Any]:
        out: list[int] = []
        rekeyed: list[int] = []
        channel = self.channels[channel_name]
        if self.target == "raw":
            frames, payload = self.raw.frames, self.step.data.cast("B")
            for _ in range(n):
                start = time.perf_counter_ns()
                await channel.send(ECHO, payload)
                await frames.get()
                out.append(time.perf_counter_ns() - start)
            return {"ns": out, "rekeyed_ns": rekeyed}
        kind, buf = self.kind.ACTIVATION, self.buf
        stats = self.channel_transport(channel_name).stats
        for _ in range(n):
            before = rekey_count(stats)  # read outside the timing
            start = time.perf_counter_ns()
            await channel.send(kind, {"m": ECHO}, self.step)
            await channel.recv(into=buf)
            elapsed = time.perf_counter_ns() - start
            out.append(elapsed)
            if rekey_count(stats) > before:
                rekeyed.append(elapsed)
        return {"ns": out, "rekeyed_ns": rekeyed}

    def channel_transport(self, channel_name: str) -> Any:
        if channel_name == "rekey":
            assert self.rekeying is not None
            return self.rekeying
        return self.transport

    async def prefill_round(self, count: int) -> dict[str, Any]:
        channel = self.channels["main"]
        start = time.perf_counter()
        if self.target == "raw":
            payload = self.prefill.data.cast("B")
            for i in range(count):
                await channel.send(STREAM_LAST if i == count - 1 else STREAM, payload)
            await self.raw.frames.get()
        else:
            for i in range(count):
                mode = STREAM_LAST if i == count - 1 else STREAM
                await channel.send(self.kind.ACTIVATION, {"m": mode}, self.prefill)
            await channel.recv()
        return {"s": time.perf_counter() - start}

    def rekeys(self) -> dict[str, Any]:
        if self.target == "raw" or self.rekeying is None:
            return {}
        stats = self.rekeying.stats
        return {"sent": stats.rekeys_sent, "received": stats.rekeys_received}

    async def close(self) -> None:
        for channel in self.channels.values():
            if self.target == "raw":
                await self.raw.close(channel)
            else:
                await channel.close()


def rekey_count(stats: Any) -> int:
    """Rekeys sent and received so far (protocol 1 has none)."""
    return getattr(stats, "rekeys_sent", 0) + getattr(stats, "rekeys_received", 0)


def machine_info() -> dict[str, Any]:
    from importlib import metadata

    from mlxppd.runtime.system import event_loop

    info: dict[str, Any] = {"python": platform.python_version(), "loop": "?"}
    info["loop"] = event_loop.event_loop_factory()[0]
    import mlxppd

    info["mlxppd"] = str(Path(mlxppd.__file__).parent)
    try:
        from mlxppd.wire.version import PROTOCOL_VERSION

        info["protocol"] = PROTOCOL_VERSION
    except ImportError:
        info["protocol"] = "?"
    info["cryptography"] = metadata.version("cryptography")
    try:
        from cryptography.hazmat.backends.openssl.backend import backend

        info["openssl"] = backend.openssl_version_text()
    except Exception:  # only a label
        info["openssl"] = "?"
    return info


async def driver_main(target: str, backend: str, rekey_after: int, peer_cpu: int | None) -> None:
    peer = subprocess.Popen(
        [sys.executable, str(HERE), "--peer", target, "--backend", backend]
        + ["--rekey-after", str(rekey_after)]
        + ([] if peer_cpu is None else ["--cpu", str(peer_cpu)]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert peer.stdout is not None and peer.stdin is not None
    try:
        first, second = (int(p) for p in peer.stdout.readline().split())
        driver = Driver(target, backend, (first, second), rekey_after)
        await driver.open()
        reply(dict(machine_info(), channels=sorted(driver.channels)))
        for line in sys.stdin:  # blocking between blocks: nothing is in flight then
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "handshake":
                reply(await driver.handshakes(cmd["n"]))
            elif cmd["op"] == "step":
                reply(await driver.steps(cmd["n"], cmd["channel"]))
            elif cmd["op"] == "prefill":
                reply(await driver.prefill_round(cmd["count"]))
            elif cmd["op"] == "rekeys":
                reply(driver.rekeys())
        await driver.close()
    finally:
        peer.stdin.close()
        peer.wait(timeout=10)


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--driver", help="the target this driver measures (raw, v1, v2)")
    parser.add_argument("--peer", help="run the listener of this target instead")
    parser.add_argument("--backend", default="tcp", choices=("tcp", "rdma"))
    parser.add_argument("--rekey-after", type=int, default=1000)
    parser.add_argument("--cpu", type=int, help="pin this process to the CPU")
    parser.add_argument("--peer-cpu", type=int, help="pin the peer to the CPU")
    args = parser.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    from mlxppd.runtime.system import event_loop

    if args.peer:
        event_loop.run(peer_main(args.peer, args.backend, args.rekey_after))
    elif args.driver:
        event_loop.run(driver_main(args.driver, args.backend, args.rekey_after, args.peer_cpu))
    else:
        parser.error("--driver or --peer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
