"""One-way latency and bandwidth of the stage transports against a raw socket, in one run.

    .venv/bin/python bench/transport.py [--quick]

Prints a markdown table: p50/p95/p99 one-way latency and streaming bandwidth for four payloads
that mirror real activations, over a raw unencrypted loopback socket (two baselines, below), the
secure ``tcp`` backend and the secure ``rdma`` backend, each with its ratios to the baselines.

Method. One receiver process per transport listens on 127.0.0.1; this process sends.

* Latency: the sender writes ``time.perf_counter_ns()`` (CLOCK_MONOTONIC, shared by the
  processes of a host) into the first 8 payload bytes and sends; the receiver reads the clock
  once the whole message is in its buffer (for the secure transports: authenticated and
  decrypted) and returns the difference in a small ack. The next message goes only after the
  ack, so nothing queues.
* Bandwidth: N messages back to back, one ack after the last: bytes / (ack time - start);
  three interleaved rounds, the best one counts.
* Receivers reuse one buffer per connection, as a stage does before it wraps the bytes in an
  mx.array: ``recv_into`` for raw, ``recv(into=...)`` for the secure transports.
* Two baselines, both unencrypted length-prefixed frames from a blocking sender: ``raw``
  receives with blocking sockets (the cheapest way Python moves bytes), ``raw-asyncio`` on an
  event loop with ``recv_into`` a preallocated buffer (the cheapest way asyncio does, and the
  I/O model mlxppd runs on). The ratio to ``raw-asyncio`` is what the secure protocol costs.
* Every event loop here is the one mlxppd runs on (``mlxppd.runtime.system.event_loop``:
  uvloop where installed; ``MLXPP_EVENT_LOOP=asyncio`` measures asyncio's own loop instead).
* Transports take turns in blocks of ``--block`` (25) messages, so a noisy neighbour slows
  every row alike. A block, not a single message: each receiver is its own process on the same
  CPU, and switching transports after every message lets four interpreters evict each other's
  caches between any two messages, which costs the transports that run more Python per
  message most (``--block 1`` shows it: about +10 µs per secure decode step here). A stage
  process owns its connection; it does not share its CPU with three other transports.
* The sender and the receivers are pinned to different CPUs, as stages on different hosts
  are (the CPUs are chosen once, in the parent, before it pins itself).

Goals: decode-step p50 <= 1.5x the raw baseline; prefill bandwidth >= 50% of it.

A second table follows (``bench/transport_versions.py``, where its method is described):
protocol 2 (this tree) against protocol 1 (``--baseline-tree``, default a worktree of
b324e25) and a raw socket: handshake time, the 8 KiB decode-step round trip, 4 MiB prefill
throughput, the v2/v1 ratios against their goals, and the cost of rekeying. ``--only`` runs
one of the two tables.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

from mlxppd.core.config.roster import Roster
from mlxppd.runtime.system import event_loop
from mlxppd.wire.backends import create_transport
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import MessageKind
from mlxppd.wire.errors import ChannelClosedError
from mlxppd.wire.limits import FrameLimits
from mlxppd.wire.node_key import NodeKey
from mlxppd.wire.rdma import RdmaTransport
from mlxppd.wire.roster_book import RosterBook
from mlxppd.wire.secret import load_cluster_secret
from mlxppd.wire.transport import WireConfig

try:  # run as a script, bench/ is on sys.path; as ``-m bench.transport``, the root is
    import transport_versions as versions
    from transport_versions_driver import node_key_bytes
except ImportError:
    from bench import transport_versions as versions  # type: ignore[no-redef]
    from bench.transport_versions_driver import node_key_bytes  # type: ignore[no-redef]

RAW_HEADER = struct.Struct("<II")  # payload length, mode
LATENCY, STREAM, STREAM_LAST = 0, 1, 2
STAMP = struct.Struct("<q")
LIMITS = FrameLimits(max_frame_bytes=64 * 1024 * 1024)
#: raw: blocking sockets on both ends; raw-asyncio: the same bytes, received on an asyncio loop
#: (recv_into a preallocated buffer, as cheap as asyncio gets); tcp, rdma: the secure backends.
BACKENDS = ("raw", "raw-asyncio", "tcp", "rdma")
BASELINES = ("raw", "raw-asyncio")


@dataclass(frozen=True)
class Payload:
    name: str
    shape: tuple[int, ...]
    dtype: str
    latency_runs: int
    stream_count: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


PAYLOADS = [
    Payload("RPC message (256 B)", (256,), "uint8", 1500, 3000),
    Payload("decode step 1x1x4096 fp16 (8 KiB)", (1, 1, 4096), "float16", 1500, 3000),
    Payload("prefill 1x512x4096 fp16 (4 MiB)", (1, 512, 4096), "float16", 100, 80),
    Payload("hand-off 4x1024x4096 fp16 (32 MiB)", (4, 1024, 4096), "float16", 25, 12),
]


def wire_config(node: str) -> WireConfig:
    # The secret travels to the receivers in MLXPP_CLUSTER_SECRET, the third lookup source;
    # each side derives both throwaway node keys from it, so the roster needs no exchange.
    secret = os.environ["MLXPP_CLUSTER_SECRET"]
    keys = {
        n: NodeKey.from_private_bytes(node_key_bytes(secret, n), "bench")
        for n in ("sender", "receiver")
    }
    return WireConfig(
        "bench",
        node,
        load_cluster_secret(environ=os.environ),
        node_key=keys[node],
        roster=RosterBook(Roster.of({n: k.public for n, k in keys.items()})),
        limits=LIMITS,
    )


# -- receivers (one child process per transport) -----------------------------------------------


def receive_raw() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(LIMITS.max_frame_bytes)
    view = memoryview(buf)
    head = bytearray(RAW_HEADER.size)

    def fill(target: memoryview) -> bool:
        while target:
            n = conn.recv_into(target)
            if n == 0:
                return False
            target = target[n:]
        return True

    while fill(memoryview(head)):
        length, mode = RAW_HEADER.unpack(head)
        if not fill(view[:length]):
            return
        arrived = time.perf_counter_ns()
        if mode == LATENCY:
            conn.sendall(STAMP.pack(arrived - STAMP.unpack_from(buf)[0]))
        elif mode == STREAM_LAST:
            conn.sendall(STAMP.pack(0))


class _RawProtocol(asyncio.BufferedProtocol):
    """The raw baseline on an event loop: frames land by recv_into in one preallocated buffer."""

    def __init__(self, finished: asyncio.Event):
        self.finished = finished
        self.buf = bytearray(LIMITS.max_frame_bytes + RAW_HEADER.size)
        self.view = memoryview(self.buf)
        self.have = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.have :]

    def buffer_updated(self, nbytes: int) -> None:
        self.have += nbytes
        while self.have >= RAW_HEADER.size:
            length, mode = RAW_HEADER.unpack_from(self.buf)
            end = RAW_HEADER.size + length
            if self.have < end:
                return
            arrived = time.perf_counter_ns()
            assert self.transport is not None
            if mode == LATENCY:
                sent = STAMP.unpack_from(self.buf, RAW_HEADER.size)[0]
                self.transport.write(STAMP.pack(arrived - sent))
            elif mode == STREAM_LAST:
                self.transport.write(STAMP.pack(0))
            self.view[: self.have - end] = self.view[end : self.have]
            self.have -= end

    def connection_lost(self, exc: Exception | None) -> None:
        self.finished.set()


async def receive_raw_asyncio() -> None:
    finished = asyncio.Event()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _RawProtocol(finished), "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await finished.wait()
    server.close()


async def receive_secure(backend: str) -> None:
    finished = asyncio.Event()

    async def handler(channel: SecureChannel) -> None:
        buf = bytearray(LIMITS.max_frame_bytes)
        try:
            while True:
                message = await channel.recv(into=buf)
                arrived = time.perf_counter_ns()
                mode = message.meta["m"]
                if mode == LATENCY:
                    sent = STAMP.unpack_from(buf)[0]
                    await channel.send(MessageKind.REPLY, {"ns": arrived - sent})
                elif mode == STREAM_LAST:
                    await channel.send(MessageKind.REPLY, {"ns": 0})
        except ChannelClosedError:
            finished.set()

    transport = create_transport(backend, wire_config("receiver"))
    async with await transport.listen("127.0.0.1", 0, handler) as listener:
        print(listener.address[1], flush=True)
        await finished.wait()


# -- senders -----------------------------------------------------------------------------------


class RawSender:
    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.ack = bytearray(STAMP.size)

    def _send(self, data: np.ndarray, mode: int) -> None:
        self.sock.sendmsg([RAW_HEADER.pack(data.nbytes, mode), data.data.cast("B")])

    def _ack(self) -> int:
        view = memoryview(self.ack)
        while view:
            view = view[self.sock.recv_into(view) :]
        return int(STAMP.unpack(self.ack)[0])

    async def latency(self, data: np.ndarray) -> int:
        _stamp(data)
        self._send(data, LATENCY)
        return self._ack()

    async def stream(self, data: np.ndarray, count: int) -> float:
        start = time.perf_counter()
        for i in range(count):
            self._send(data, STREAM_LAST if i == count - 1 else STREAM)
        self._ack()
        return time.perf_counter() - start

    async def close(self) -> None:
        self.sock.close()


class SecureSender:
    def __init__(self, channel: SecureChannel):
        self.channel = channel

    async def latency(self, data: np.ndarray) -> int:
        _stamp(data)
        await self.channel.send(MessageKind.ACTIVATION, {"m": LATENCY}, data)
        return int((await self.channel.recv()).meta["ns"])

    async def stream(self, data: np.ndarray, count: int) -> float:
        start = time.perf_counter()
        for i in range(count):
            mode = STREAM_LAST if i == count - 1 else STREAM
            await self.channel.send(MessageKind.ACTIVATION, {"m": mode}, data)
        await self.channel.recv()
        return time.perf_counter() - start

    async def close(self) -> None:
        await self.channel.close()


def _stamp(data: np.ndarray) -> None:
    STAMP.pack_into(data.data.cast("B"), 0, time.perf_counter_ns())


# -- the run -----------------------------------------------------------------------------------


@dataclass
class Row:
    latencies_us: list[float]
    bandwidth: float  # bytes per second


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


async def measure(
    quick: bool, block: int, receiver_cpu: int | None
) -> tuple[dict[tuple[str, str], Row], str]:
    env = dict(os.environ, MLXPP_CLUSTER_SECRET=secrets.token_hex(32))
    os.environ["MLXPP_CLUSTER_SECRET"] = env["MLXPP_CLUSTER_SECRET"]
    children = {
        b: subprocess.Popen(
            [sys.executable, __file__, "--receive", b]
            + ([] if receiver_cpu is None else ["--cpu", str(receiver_cpu)]),
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for b in BACKENDS
    }
    senders: dict[str, RawSender | SecureSender] = {}
    probe = ""
    try:
        for backend, child in children.items():
            assert child.stdout is not None
            port = int(child.stdout.readline())
            if backend in BASELINES:
                senders[backend] = RawSender(port)
                continue
            transport = create_transport(backend, wire_config("sender"))
            if isinstance(transport, RdmaTransport):
                probe = transport.probe().reason
            senders[backend] = SecureSender(await transport.connect("127.0.0.1", port))
        rows: dict[tuple[str, str], Row] = {}
        scale = 0.2 if quick else 1.0
        for payload in PAYLOADS:
            data = np.ones(payload.shape, dtype=payload.dtype)
            runs = max(5, int(payload.latency_runs * scale))
            count = max(3, int(payload.stream_count * scale))
            latencies: dict[str, list[float]] = {b: [] for b in BACKENDS}
            for _ in range(3):  # warm-up: page in buffers, grow socket windows
                for b in BACKENDS:
                    await senders[b].latency(data)
            # Take turns in blocks: drift hits the transports alike.
            for start in range(0, runs, block):
                for b in BACKENDS:
                    for _ in range(min(block, runs - start)):
                        latencies[b].append((await senders[b].latency(data)) / 1000)
            best = {b: float("inf") for b in BACKENDS}
            for _ in range(3):  # interleaved rounds; the best one is the least disturbed
                for b in BACKENDS:
                    best[b] = min(best[b], await senders[b].stream(data, count))
            for b in BACKENDS:
                rows[(payload.name, b)] = Row(latencies[b], payload.nbytes * count / best[b])
        return rows, probe
    finally:
        for sender in senders.values():
            with contextlib.suppress(Exception):
                await sender.close()
        for child in children.values():
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()


def render(rows: dict[tuple[str, str], Row], probe: str) -> str:
    lines = [
        "| payload | transport | p50 µs | p95 µs | p99 µs | p50 vs raw | p50 vs raw-asyncio "
        "| MiB/s | MiB/s vs raw | MiB/s vs raw-asyncio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for payload in PAYLOADS:
        p50s = {b: percentile(rows[(payload.name, b)].latencies_us, 50) for b in BACKENDS}
        for b in BACKENDS:
            row = rows[(payload.name, b)]
            bw = {base: row.bandwidth / rows[(payload.name, base)].bandwidth for base in BASELINES}
            p95, p99 = (percentile(row.latencies_us, q) for q in (95, 99))
            lines.append(
                f"| {payload.name} | {b} | {p50s[b]:.1f} | {p95:.1f} | {p99:.1f} "
                f"| {p50s[b] / p50s['raw']:.2f}x | {p50s[b] / p50s['raw-asyncio']:.2f}x "
                f"| {row.bandwidth / 2**20:.0f} | {bw['raw']:.0%} | {bw['raw-asyncio']:.0%} |"
            )
    decode, prefill = PAYLOADS[1].name, PAYLOADS[2].name
    lines.append("")
    for b in ("tcp", "rdma"):
        for base in BASELINES:
            ratio = percentile(rows[(decode, b)].latencies_us, 50) / percentile(
                rows[(decode, base)].latencies_us, 50
            )
            share = rows[(prefill, b)].bandwidth / rows[(prefill, base)].bandwidth
            lines.append(
                f"- {b} vs {base}: decode-step p50 {ratio:.2f}x (goal <= 1.5x: "
                f"{'met' if ratio <= 1.5 else 'MISSED'}); prefill bandwidth {share:.0%} "
                f"(goal >= 50%: {'met' if share >= 0.5 else 'MISSED'})"
            )
    lines.append(f"- rdma probe on this host: {probe or 'not run'}")
    return "\n".join(lines)


def cpu_pair() -> tuple[int, int] | None:
    """The CPUs for the sender and the receivers, when this process may use two or more.

    Decided once, in the parent, before it pins itself: a child reading its own affinity after
    that would only see the sender's CPU and share it.
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else None


def pin(cpu: int | None) -> None:
    """Keep sender and receivers on different CPUs, as stages on different hosts are.

    On one CPU a blocking receiver is woken by a switch on the sender's CPU, and whatever the
    sender does after its send delays the receiver: the more a transport does per message, the
    more it would be penalised twice.
    """
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a fifth of the iterations")
    parser.add_argument(
        "--block",
        type=int,
        default=25,
        help="latency messages per transport before the next one takes its turn (default 25)",
    )
    parser.add_argument(
        "--only", choices=("transports", "versions"), help="print only one of the two tables"
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="the protocol-1 tree for the versions table (default: a temporary git worktree of "
        f"{versions.PROTOCOL_1_COMMIT})",
    )
    parser.add_argument("--receive", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    pair = None if args.receive else cpu_pair()
    pin(args.cpu if args.receive else pair and pair[0])
    if args.receive == "raw":
        receive_raw()
        return 0
    if args.receive == "raw-asyncio":
        event_loop.run(receive_raw_asyncio())
        return 0
    if args.receive:
        event_loop.run(receive_secure(args.receive))
        return 0
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    if args.only != "versions":
        rows, probe = event_loop.run(measure(args.quick, max(1, args.block), pair and pair[1]))
        print(render(rows, probe))
        print(f"- run: latency in blocks of {max(1, args.block)} messages per transport")
        print()
    if args.only != "transports":
        with versions.baseline_tree(args.baseline_tree) as baseline:
            print(versions.run_comparison(quick=args.quick, baseline=baseline, cpus=pair))
    print(
        f"- runs: event loop {event_loop.event_loop_factory()[0]}; "
        f"{time.perf_counter() - started:.0f} s on {os.cpu_count()} CPUs, load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after (other work skews the numbers)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
