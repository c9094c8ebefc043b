"""Protocol 2's Noise channel against mutual TLS 1.3 from the standard library, in one run.

    .venv/bin/python bench/tls_vs_noise.py [--quick]

The choice this informed (docs/security.md, "Why Noise, and not TLS 1.3"): both give forward
secrecy and mutual authentication; this measures what each costs on the same loop, the same
loopback socket and the same messages. Both ends run in this process on mlxppd's event loop
(uvloop where installed), so the figures compare the two protocols' Python and crypto paths,
not process scheduling.

* handshake: TCP connect until the channel carries its first message, p50 and p99;
* decode step: an 8 KiB message echoed back (round trip), p50 and p99;
* prefill: 4 MiB messages one way, then one ack, MB/s (the best of three rounds).

TLS: TLS 1.3 only, each side a self-signed Ed25519 certificate that the other pins as its only
trust anchor (client certificates required), AES-256-GCM, messages length-prefixed over
asyncio's streams. Noise: mlxppd's own tcp transport (XXpsk3, AES-256-GCM records).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import ssl
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import cryptography
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID

from mlxppd.core.config.roster import Roster
from mlxppd.runtime.system import event_loop
from mlxppd.wire.backends import create_transport
from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import MessageKind
from mlxppd.wire.limits import FrameLimits
from mlxppd.wire.node_key import NodeKey
from mlxppd.wire.roster_book import RosterBook
from mlxppd.wire.secret import ClusterSecret
from mlxppd.wire.transport import WireConfig

STEP = 8 * 1024
PREFILL = 4 * 1024 * 1024
LENGTH = struct.Struct(">I")
LIMITS = FrameLimits(max_frame_bytes=64 * 1024 * 1024)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- TLS 1.3 -----------------------------------------------------------------------------------


def _self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    key = Ed25519PrivateKey.generate()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, None)
    )
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def _contexts(directory: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    server_cert, server_key = _self_signed(directory, "server")
    client_cert, client_key = _self_signed(directory, "client")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for ctx, (cert, key), peer in (
        (server, (server_cert, server_key), client_cert),
        (client, (client_cert, client_key), server_cert),
    ):
        ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(peer)
        ctx.verify_mode = ssl.CERT_REQUIRED
    client.check_hostname = True
    return server, client


async def _read_message(reader: asyncio.StreamReader) -> bytes:
    (n,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    return await reader.readexactly(n)


def _write_message(writer: asyncio.StreamWriter, payload: bytes) -> None:
    writer.write(LENGTH.pack(len(payload)))
    writer.write(payload)


async def tls_run(rounds: Rounds) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        server_ctx, client_ctx = _contexts(Path(tmp))

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    message = await _read_message(reader)
                    if len(message) == STEP or len(message) == 1:
                        _write_message(writer, message)  # echo a step, ack a marker
                        await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]

        async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=client_ctx, server_hostname="server"
            )
            _write_message(writer, b"h")
            await writer.drain()
            await _read_message(reader)
            return reader, writer

        async def close(pair: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
            pair[1].close()
            await pair[1].wait_closed()

        reader, writer = await connect()

        async def step(payload: bytes) -> None:
            _write_message(writer, payload)
            await writer.drain()
            await _read_message(reader)

        async def prefill(payload: bytes, count: int) -> None:
            for _ in range(count):
                _write_message(writer, payload)
                await writer.drain()
            _write_message(writer, b"a")
            await writer.drain()
            await _read_message(reader)

        result = await rounds.measure(connect, close, step, prefill)
        await close((reader, writer))
        server.close()
        await server.wait_closed()
        return result


# -- protocol 2 --------------------------------------------------------------------------------


async def noise_run(rounds: Rounds) -> dict[str, float]:
    secret = ClusterSecret(os.urandom(32), "bench")
    keys = {"server": NodeKey.generate(), "client": NodeKey.generate()}
    roster = Roster.of({n: k.public for n, k in keys.items()})

    def config(node: str) -> WireConfig:
        return WireConfig("bench", node, secret, keys[node], RosterBook(roster), limits=LIMITS)

    server = create_transport("tcp", config("server"))
    client = create_transport("tcp", config("client"))

    async def echo(channel: SecureChannel) -> None:
        async for message in channel:
            tensor = message.tensor
            if tensor is None or tensor.nbytes in (STEP, 1):
                await channel.send(MessageKind.REPLY, None, tensor)

    listener = await server.listen("127.0.0.1", 0, echo)
    port = listener.address[1]
    marker = memoryview(b"h")

    async def connect() -> SecureChannel:
        channel = await client.connect("127.0.0.1", port)
        await channel.send(MessageKind.CONTROL, None, marker)
        await channel.recv()
        return channel

    async def close(channel: SecureChannel) -> None:
        await channel.close()

    channel = await connect()

    async def step(payload: bytes) -> None:
        await channel.send(MessageKind.CONTROL, None, memoryview(payload))
        await channel.recv()

    async def prefill(payload: bytes, count: int) -> None:
        view = memoryview(payload)
        for _ in range(count):
            await channel.send(MessageKind.CONTROL, None, view)
        await channel.send(MessageKind.CONTROL, None, marker)
        await channel.recv()

    result = await rounds.measure(connect, close, step, prefill)
    await channel.close()
    await listener.close()
    return result


# -- the measurement ---------------------------------------------------------------------------


class Rounds:
    def __init__(self, quick: bool):
        self.handshakes = 30 if quick else 200
        self.steps = 300 if quick else 3000
        self.prefills = 10 if quick else 50

    async def measure(
        self,
        connect: Callable[[], Awaitable[object]],
        close: Callable[[object], Awaitable[None]],
        step: Callable[[bytes], Awaitable[None]],
        prefill: Callable[[bytes, int], Awaitable[None]],
    ) -> dict[str, float]:
        handshakes = []
        for _ in range(self.handshakes):
            started = time.perf_counter()
            pair = await connect()
            handshakes.append(time.perf_counter() - started)
            await close(pair)
        payload = os.urandom(STEP)
        for _ in range(50):
            await step(payload)  # warm-up
        steps = []
        for _ in range(self.steps):
            started = time.perf_counter()
            await step(payload)
            steps.append(time.perf_counter() - started)
        big = os.urandom(PREFILL)
        await prefill(big, 2)
        rates = []
        for _ in range(3):
            started = time.perf_counter()
            await prefill(big, self.prefills)
            rates.append(self.prefills * PREFILL / (time.perf_counter() - started) / 1e6)
        return {
            "handshake_p50_ms": statistics.median(handshakes) * 1e3,
            "handshake_p99_ms": _percentile(handshakes, 0.99) * 1e3,
            "step_p50_us": statistics.median(steps) * 1e6,
            "step_p99_us": _percentile(steps, 0.99) * 1e6,
            "prefill_mb_s": max(rates),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (under a minute)")
    args = parser.parse_args(argv)
    rounds = Rounds(args.quick)
    noise = event_loop.run(noise_run(rounds))
    tls = event_loop.run(tls_run(rounds))
    print(
        f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"cryptography {cryptography.__version__}, {ssl.OPENSSL_VERSION}, {sys.platform}\n"
    )
    print("| | handshake p50 | handshake p99 | 8 KiB step p50 | step p99 | 4 MiB prefill |")
    print("|---|---|---|---|---|---|")
    for name, r in (("protocol 2 (Noise XXpsk3)", noise), ("mutual TLS 1.3 (ssl)", tls)):
        print(
            f"| {name} | {r['handshake_p50_ms']:.2f} ms | {r['handshake_p99_ms']:.2f} ms | "
            f"{r['step_p50_us']:.0f} µs | {r['step_p99_us']:.0f} µs | "
            f"{r['prefill_mb_s']:.0f} MB/s |"
        )
    print(
        f"| Noise / TLS | {noise['handshake_p50_ms'] / tls['handshake_p50_ms']:.2f}x | | "
        f"{noise['step_p50_us'] / tls['step_p50_us']:.2f}x | | "
        f"{noise['prefill_mb_s'] / tls['prefill_mb_s']:.2f}x |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
