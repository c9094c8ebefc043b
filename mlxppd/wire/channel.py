"""An established secure channel: send and receive codec messages in AES-GCM records.

One channel per connection, created by a transport once the handshake accepted it. Sends from
many tasks are serialized (the record sequence numbers must follow wire order); receives are for
one task at a time. Every
frame that fails a check is counted in ``WireStats.rejected_frames``, logged once with the peer
address, and closes the connection; the exception then tells the caller what happened.

Keys are replaced (``record.py``, "Rekeying") once a direction has sealed
``RekeyPolicy.after_records`` records or held its key ``after_s`` seconds: the sender checks
before each message, so traffic never waits for it.

Small records are sealed and opened in one call. Large ones are streamed in ``chunk_size``
pieces: the cipher reads the tensor straight from its own memory into the stream's send buffer,
and on receipt decrypts straight into the memory the tensor will live in (``recv(into=...)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxppd.core.log_text import quoted
from mlxppd.wire.codec import (
    Message,
    MessageAssembler,
    MessageKind,
    Tensor,
    as_tensor,
    decode_message,
    encode_parts,
)
from mlxppd.wire.errors import ChannelClosedError, FrameError, FrameRejectReason
from mlxppd.wire.limits import FrameLimits
from mlxppd.wire.record import (
    RECORD_HEADER,
    TAG_SIZE,
    RecordOpener,
    RecordSealer,
    RecordType,
    parse_record_header,
)
from mlxppd.wire.stats import WireStats
from mlxppd.wire.streams import ByteStream, StreamEOF

__all__ = [
    "SMALL_RECORD_BYTES",
    "RekeyPolicy",
    "SecureChannel",
    "SendTurns",
    "read_small_record",
]

log = logging.getLogger(__name__)

#: Records up to this size (header + ciphertext + tag) are sealed and opened in one call;
#: larger ones are streamed piece by piece.
SMALL_RECORD_BYTES = 64 * 1024
#: Plaintext bound of the records that are not messages (verdict, close).
_CONTROL_RECORD_MAX = 1024
_GOODBYE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class RekeyPolicy:
    """When a sending direction replaces its key."""

    #: records sealed with one key before it is replaced (2**24: 16 M decode steps)
    after_records: int = 1 << 24
    #: seconds one key is used at most (checked when a message is sent)
    after_s: float = 120.0
    #: monotonic seconds; tests pass their own
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.after_records < 1 or not self.after_s > 0:
            raise ValueError("rekey_after_records must be >= 1 and rekey_after_s > 0")


class SendTurns:
    """Whose turn it is to write a record: first come, first served.

    Records must reach the wire in the order they were sealed, so one sender at a time seals
    and writes. Unlike ``asyncio.Lock``, a free turn is taken without a coroutine, and a
    finished turn is handed straight to the next waiter: a decode step that finds the channel
    idle seals and sends without yielding to the loop.
    """

    __slots__ = ("_busy", "_waiters")

    def __init__(self) -> None:
        self._busy = False
        self._waiters: deque[asyncio.Future[None]] = deque()

    def try_take(self) -> bool:
        """Take the turn if nobody holds it or waits for it."""
        if self._busy or self._waiters:
            return False
        self._busy = True
        return True

    async def take(self) -> None:
        """Wait for the turn."""
        if self.try_take():
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled():
                self.give_back()  # handed over just as this waiter was cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(turn)
            raise

    def give_back(self) -> None:
        """End this turn: the next waiter's, or nobody's."""
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)  # still busy: the turn passes directly
                return
        self._busy = False


async def read_small_record(
    stream: ByteStream, opener: RecordOpener, limits: FrameLimits
) -> tuple[RecordType, bytes]:
    """Read and open one record that must be small (a verdict or a goodbye)."""
    header = bytes(await _read_or_truncated(stream, RECORD_HEADER.size, at_boundary=True))
    rtype, length = parse_record_header(header, limits)
    if length > _CONTROL_RECORD_MAX:  # whatever its type, nothing larger is expected here
        raise FrameError(FrameRejectReason.LENGTH_EXCEEDS_MAX, f"{rtype.name} record of {length} B")
    sealed = await _read_or_truncated(stream, length + TAG_SIZE, at_boundary=False)
    plain = bytearray(length)
    opener.open_into(header, sealed, memoryview(plain))
    return rtype, bytes(plain)


async def _read_or_truncated(
    stream: ByteStream, n: int, *, at_boundary: bool
) -> bytes | memoryview:
    try:
        return await stream.read_exactly(n)
    except StreamEOF as eof:
        if at_boundary and eof.received == 0:
            raise ChannelClosedError(
                f"peer {stream.peer} closed the connection without a goodbye", clean=False
            ) from None
        raise FrameError(
            FrameRejectReason.TRUNCATED, "the connection ended inside a record"
        ) from None


class SecureChannel:
    """Authenticated, encrypted, ordered messages to one peer node."""

    def __init__(
        self,
        stream: ByteStream,
        sealer: RecordSealer,
        opener: RecordOpener,
        *,
        limits: FrameLimits,
        stats: WireStats,
        local_node_id: str,
        peer_node_id: str,
        peer_rdma_version: int = 0,
        peer_key: bytes = b"",
        rekey: RekeyPolicy | None = None,
    ):
        self._stream = stream
        self._sealer = sealer
        self._opener = opener
        self._limits = limits
        self._stats = stats
        self.local_node_id = local_node_id
        self.peer_node_id = peer_node_id
        self.peer_rdma_version = peer_rdma_version
        #: the node key the peer proved it holds in the handshake
        self.peer_key = peer_key
        self._rekey = rekey if rekey is not None else RekeyPolicy()
        self._clock = self._rekey.clock
        self._key_deadline = self._clock() + self._rekey.after_s
        self._turns = SendTurns()
        self._receiving = False
        self._plain = memoryview(b"")  # plaintext scratch of small records received ``into``
        self._in_record = False  # a read failing now cuts a record short
        self._closed = False

    @property
    def peer_address(self) -> str:
        """The peer's ``host:port`` as this connection sees it."""
        return self._stream.peer

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"SecureChannel(peer={self.peer_node_id!r} at {self.peer_address})"

    @property
    def key_epochs(self) -> tuple[int, int]:
        """How many times (sending, receiving) keys were replaced."""
        return self._sealer.epoch, self._opener.epoch

    def key_fingerprints(self) -> tuple[bytes, bytes]:
        """Short one-way ids of the current (sending, receiving) keys, for tests and logs."""
        return self._sealer.key_fingerprint(), self._opener.key_fingerprint()

    def revoke(self) -> None:
        """Close now, without a goodbye: the peer is no longer trusted (roster removal)."""
        self._abort()

    # -- sending ------------------------------------------------------------------------------

    async def send(
        self,
        kind: MessageKind,
        meta: Mapping[str, Any] | None = None,
        tensor: Tensor | object | None = None,
    ) -> None:
        """Send one message; ``tensor`` is a Tensor or any C-contiguous buffer (not copied)."""
        head, payload = encode_parts(
            kind, meta, None if tensor is None else as_tensor(tensor), self._limits
        )
        turns = self._turns
        if not turns.try_take():
            await turns.take()
        try:
            if self._closed:
                self._check_open()
            if (
                self._sealer.records_on_key >= self._rekey.after_records
                or self._clock() >= self._key_deadline
            ):
                await self._send_rekey()
            total = RECORD_HEADER.size + len(head) + payload.nbytes + TAG_SIZE
            if total <= SMALL_RECORD_BYTES:  # every decode step: sealed in one call
                stream = self._stream
                out = stream.scratch(total)
                self._sealer.seal_into(RecordType.MESSAGE, (head, payload), out)
                sent = stream.write_nowait(out)
                if sent < total:
                    await stream.write((out[sent:],))
            else:
                await self._send_record(RecordType.MESSAGE, head, payload)
        except (ConnectionError, OSError) as exc:
            self._abort()
            raise ChannelClosedError(
                f"connection to {self._describe()} lost while sending: {exc}", clean=False
            ) from None
        finally:
            turns.give_back()

    async def _send_rekey(self) -> None:
        # The REKEY record is the last one sealed with the old key; the peer ratchets on it.
        record = self._sealer.seal(RecordType.REKEY, ())
        self._sealer.rekey()
        self._key_deadline = self._clock() + self._rekey.after_s
        self._stats.rekeys_sent += 1
        sent = self._stream.write_nowait(memoryview(record))
        if sent < len(record):
            await self._stream.write((memoryview(record)[sent:],))

    async def _send_record(self, rtype: RecordType, head: bytes, payload: memoryview) -> None:
        length = len(head) + payload.nbytes
        total = RECORD_HEADER.size + length + TAG_SIZE
        if total <= SMALL_RECORD_BYTES:
            out = self._stream.scratch(total)
            self._sealer.seal_into(rtype, (head, payload), out)
            await self._stream.write((out,))
            return
        # Streamed: each piece is encrypted into the stream's send buffer and written while
        # it is still in cache; the record header rides along with the first piece, the tag
        # with the last, as one scatter-gather write each.
        seal = self._sealer.start(rtype, length)
        left = length
        prefix: list[bytes | memoryview] = [seal.header]
        buf = self._stream.scratch(min(self._stream.chunk_size, left))
        pos = 0
        for piece in (memoryview(head), payload):
            off = 0
            while off < len(piece):
                n = min(len(buf) - pos, len(piece) - off)
                seal.update_into(piece[off : off + n], buf[pos : pos + n])
                pos += n
                off += n
                if pos == len(buf):
                    left -= pos
                    tail = [seal.finish()] if left == 0 else []
                    await self._stream.write([*prefix, buf, *tail])
                    prefix = []
                    if left:
                        buf = self._stream.scratch(min(self._stream.chunk_size, left))
                        pos = 0

    # -- receiving ----------------------------------------------------------------------------

    async def recv(self, *, into: object | None = None) -> Message:
        """The next message. Its tensor bytes land in ``into`` when that writable buffer is
        large enough (e.g. one reused per stage), else in fresh memory of the exact size.

        Raises ``ChannelClosedError`` when the peer closed, ``FrameError`` (after closing the
        connection) when a frame was rejected. One receiver at a time: the records of one
        direction form one sequence.
        """
        if self._closed:
            raise ChannelClosedError(f"the channel to {self._describe()} is closed", clean=True)
        if self._receiving:
            raise RuntimeError("another task is already receiving on this channel")
        self._receiving = True
        self._in_record = False
        try:
            return await self._recv_message(into)
        except (StreamEOF, FrameError, ChannelClosedError) as exc:
            if self._closed:  # this node closed the channel while a receive was waiting
                raise ChannelClosedError(
                    f"the channel to {self._describe()} was closed by this node", clean=True
                ) from None
            raise self._receive_failed(exc) from None
        finally:
            self._receiving = False

    def _receive_failed(self, exc: Exception) -> Exception:
        """Count, log and close for a failed receive; the exception to raise."""
        if isinstance(exc, StreamEOF):
            if self._in_record or exc.received:
                exc = FrameError(
                    FrameRejectReason.TRUNCATED, "the connection ended inside a record"
                )
            else:
                exc = ChannelClosedError(
                    f"{self._describe()} closed the connection without a goodbye", clean=False
                )
        if isinstance(exc, FrameError):
            self._reject(exc)
        else:
            self._abort()
        return exc

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Message]:
        """Messages until the peer says goodbye; a dropped connection raises."""
        while True:
            try:
                yield await self.recv()
            except ChannelClosedError as exc:
                if exc.clean:
                    return
                raise

    async def _recv_message(self, into: object | None) -> Message:
        while True:  # a REKEY record is consumed here; the message after it is returned
            message = await self._recv_record(into)
            if message is not None:
                return message

    async def _recv_record(self, into: object | None) -> Message | None:
        # Hot path of every decode step: kept flat, one await per read.
        stream = self._stream
        view = stream.read_nowait(RECORD_HEADER.size)
        if view is None:
            view = await stream.read_exactly(RECORD_HEADER.size)
        header = bytes(view)
        self._in_record = True
        rtype, reserved8, reserved16, sealed_len = RECORD_HEADER.unpack(header)
        if (
            rtype == RecordType.MESSAGE
            and not reserved8
            and not reserved16
            and TAG_SIZE <= sealed_len <= SMALL_RECORD_BYTES - RECORD_HEADER.size
            and sealed_len - TAG_SIZE <= self._limits.max_frame_bytes
        ):  # a small message record: read, opened and decoded without further checks here
            sealed = stream.read_nowait(sealed_len)
            if sealed is None:
                sealed = await stream.read_exactly(sealed_len)
            n = sealed_len - TAG_SIZE
            if into is None:  # the tensor will be a view of the plaintext: fresh memory
                plain = memoryview(bytearray(n))
            else:  # the tensor is copied into ``into`` (or fresh memory): reuse the scratch
                if len(self._plain) < n:
                    self._plain = memoryview(bytearray(SMALL_RECORD_BYTES))
                plain = self._plain[:n]
            self._opener.open_into(header, sealed, plain)
            return decode_message(plain, self._limits, into=into)
        rtype, length = parse_record_header(header, self._limits)
        if rtype is not RecordType.MESSAGE:
            if length > _CONTROL_RECORD_MAX:
                raise FrameError(
                    FrameRejectReason.LENGTH_EXCEEDS_MAX, f"{rtype.name} of {length} B"
                )
            sealed = await stream.read_exactly(length + TAG_SIZE)
            self._opener.open_into(header, sealed, memoryview(bytearray(length)))
            if rtype is RecordType.REKEY:
                if length:
                    raise FrameError(FrameRejectReason.BAD_HEADER, f"a REKEY record of {length} B")
                self._opener.rekey()
                self._stats.rekeys_received += 1
                self._in_record = False
                return None
            if rtype is RecordType.CLOSE:
                raise ChannelClosedError(f"{self._describe()} closed the channel", clean=True)
            raise FrameError(FrameRejectReason.UNEXPECTED_RECORD, f"a {rtype.name} record")
        opening = self._opener.start(header)
        assembler = MessageAssembler(length, self._limits, into=into)

        def decrypt(chunk: memoryview) -> None:
            off = 0
            while off < len(chunk):
                window = assembler.window()
                n = min(len(window), len(chunk) - off)
                opening.update_into(chunk[off : off + n], window[:n])
                assembler.advance(n)
                off += n

        await stream.read_through(length, decrypt)
        tag = bytes(await stream.read_exactly(TAG_SIZE))
        opening.finish(tag)  # only now is anything the assembler holds trusted
        return assembler.finish()

    # -- closing ------------------------------------------------------------------------------

    async def close(self) -> None:
        """Say goodbye (an authenticated close record) and close the connection."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_GOODBYE_TIMEOUT_S):
                await self._turns.take()
                try:
                    await self._send_record(RecordType.CLOSE, b"", memoryview(b""))
                finally:
                    self._turns.give_back()
        self._stream.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_GOODBYE_TIMEOUT_S):
                await self._stream.wait_closed()

    def _abort(self) -> None:
        self._closed = True
        self._stream.close()

    def _reject(self, exc: FrameError) -> None:
        self._stats.rejected_frames[exc.reason] += 1
        log.warning(
            "wire: rejected a frame from %s (%s): %s; closing the connection",
            self._describe(),
            exc.reason,
            exc.detail,
        )
        self._abort()

    def _check_open(self) -> None:
        if self._closed:
            raise ChannelClosedError(f"the channel to {self._describe()} is closed", clean=True)

    def _describe(self) -> str:
        return f"node {quoted(self.peer_node_id)} at {self.peer_address}"
