"""The record layer: AES-256-GCM per frame, the sequence number as the implicit nonce."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxppd.wire.channel import SecureChannel
from mlxppd.wire.codec import Message, MessageKind, as_tensor, encode_message
from mlxppd.wire.errors import ChannelClosedError, FrameError
from mlxppd.wire.limits import FrameLimits
from mlxppd.wire.record import (
    RECORD_HEADER,
    TAG_SIZE,
    RecordOpener,
    RecordSealer,
    RecordType,
    pack_record_header,
    parse_record_header,
    record_nonce,
)
from mlxppd.wire.stats import WireStats
from mlxppd.wire.streams import ByteStream, StreamEOF

pytestmark = pytest.mark.timeout(120)

KEY = bytes(range(32))
LIMITS = FrameLimits(max_frame_bytes=64 * 1024)


def test_the_nonce_is_the_sequence_number_after_four_zero_bytes() -> None:
    assert record_nonce(0) == bytes(12)
    assert record_nonce(1) == bytes(11) + b"\x01"
    assert record_nonce(2**64 - 1) == bytes(4) + b"\xff" * 8
    for bad in (-1, 2**64):
        with pytest.raises(ValueError):
            record_nonce(bad)


def test_a_record_header_is_checked_before_anything_is_allocated() -> None:
    assert parse_record_header(pack_record_header(RecordType.MESSAGE, 10), LIMITS) == (
        RecordType.MESSAGE,
        10,
    )
    exactly_max = pack_record_header(RecordType.MESSAGE, LIMITS.max_frame_bytes)
    assert parse_record_header(exactly_max, LIMITS)[1] == LIMITS.max_frame_bytes
    cases = {
        RECORD_HEADER.pack(2, 0, 0, LIMITS.max_frame_bytes + TAG_SIZE + 1): "length_exceeds_max",
        RECORD_HEADER.pack(2, 0, 0, 2**32 - 1): "length_exceeds_max",
        RECORD_HEADER.pack(2, 0, 0, TAG_SIZE - 1): "bad_header",
        RECORD_HEADER.pack(9, 0, 0, 32): "bad_header",
        RECORD_HEADER.pack(2, 1, 0, 32): "bad_header",
        RECORD_HEADER.pack(2, 0, 1, 32): "bad_header",
    }
    for header, reason in cases.items():
        with pytest.raises(FrameError) as error:
            parse_record_header(header, LIMITS)
        assert error.value.reason == reason


def _open(opener: RecordOpener, record: bytes) -> bytes:
    header, sealed = record[: RECORD_HEADER.size], record[RECORD_HEADER.size :]
    out = bytearray(len(sealed) - TAG_SIZE)
    opener.open_into(header, sealed, memoryview(out))
    return bytes(out)


def test_records_open_in_order_and_fail_out_of_order() -> None:
    sealer, opener = RecordSealer(KEY), RecordOpener(KEY)
    first, second = (sealer.seal(RecordType.MESSAGE, [m]) for m in (b"one", b"two"))
    assert _open(opener, first) == b"one"
    assert _open(opener, second) == b"two"
    late = RecordOpener(KEY)
    with pytest.raises(FrameError) as error:
        _open(late, second)  # sequence 0 expected, got the record sealed as 1
    assert error.value.reason == "bad_tag"


def test_the_header_is_authenticated_too() -> None:
    record = bytearray(RecordSealer(KEY).seal(RecordType.MESSAGE, [b"payload"]))
    record[0] = RecordType.CLOSE  # same length, another type
    with pytest.raises(FrameError, match="authentication"):
        _open(RecordOpener(KEY), bytes(record))


def test_each_direction_has_its_own_key() -> None:
    record = RecordSealer(KEY).seal(RecordType.MESSAGE, [b"x"])
    with pytest.raises(FrameError):
        _open(RecordOpener(bytes(32)), record)


def test_keys_never_show_in_a_repr() -> None:
    assert KEY.hex() not in repr(RecordSealer(KEY)) and str(KEY) not in repr(RecordOpener(KEY))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=3000), max_size=5), st.lists(st.integers(1, 999), min_size=1))
def test_streamed_sealing_produces_the_one_shot_bytes(
    pieces: list[bytes], sizes: list[int]
) -> None:
    one_shot = RecordSealer(KEY).seal(RecordType.MESSAGE, pieces)
    plaintext = b"".join(pieces)
    seal = RecordSealer(KEY).start(RecordType.MESSAGE, len(plaintext))
    out = bytearray(len(plaintext))
    pos, i = 0, 0
    while pos < len(plaintext):
        n = min(sizes[i % len(sizes)], len(plaintext) - pos)
        i += 1
        seal.update_into(plaintext[pos : pos + n], memoryview(out)[pos : pos + n])
        pos += n
    assert seal.header + bytes(out) + seal.finish() == one_shot
    # and the streamed opener accepts it
    opening = RecordOpener(KEY).start(one_shot[: RECORD_HEADER.size])
    back = bytearray(len(plaintext))
    opening.update_into(one_shot[RECORD_HEADER.size : -TAG_SIZE], memoryview(back))
    opening.finish(one_shot[-TAG_SIZE:])
    assert bytes(back) == plaintext


# -- the whole receive path, fed from memory ---------------------------------------------------


class MemoryStream(ByteStream):
    """A byte stream that yields ``data`` and then ends, in pieces of at most ``piece``."""

    def __init__(self, data: bytes, piece: int = 1 << 20):
        self.peer = "memory:0"
        self._data = memoryview(data)
        self._pos = 0
        self._piece = piece

    async def read_exactly(self, n: int) -> memoryview:
        if self._pos + n > len(self._data):
            received = len(self._data) - self._pos
            self._pos = len(self._data)
            raise StreamEOF(received)
        self._pos += n
        return self._data[self._pos - n : self._pos]

    async def read_through(self, n: int, sink: Callable[[memoryview], None]) -> None:
        done = 0
        while done < n:
            take = min(n - done, self._piece, len(self._data) - self._pos)
            if take == 0:
                raise StreamEOF(done)
            sink(self._data[self._pos : self._pos + take])
            self._pos += take
            done += take

    def scratch(self, n: int) -> memoryview:
        return memoryview(bytearray(n))

    async def write(self, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        pass

    def close(self) -> None:
        pass

    async def wait_closed(self) -> None:
        pass


def receive(data: bytes, piece: int = 1 << 20, limits: FrameLimits = LIMITS) -> Message:
    """What a channel makes of ``data`` arriving in pieces of ``piece`` bytes."""
    channel = SecureChannel(
        MemoryStream(data, piece),
        RecordSealer(KEY),
        RecordOpener(KEY),
        limits=limits,
        stats=WireStats(),
        local_node_id="me",
        peer_node_id="peer",
    )
    return asyncio.run(channel.recv())


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=300))
def test_arbitrary_bytes_on_the_wire_only_ever_raise_frame_errors(data: bytes) -> None:
    with pytest.raises(FrameError):
        receive(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.sampled_from([1 << 20, 7]))
def test_arbitrary_plaintext_in_an_authentic_record_only_ever_raises_frame_errors(
    plaintext: bytes, piece: int
) -> None:
    record = RecordSealer(KEY).seal(RecordType.MESSAGE, [plaintext])
    try:
        receive(record, piece)
    except FrameError:
        pass


def test_a_large_record_is_opened_piece_by_piece_as_it_arrives() -> None:
    payload = os.urandom(200_000)  # above SMALL_RECORD_BYTES: the streamed path
    tensor = as_tensor(np.frombuffer(payload, np.uint8))
    big = FrameLimits(max_frame_bytes=1 << 20)
    encoded = encode_message(Message(MessageKind.ACTIVATION, {"k": 1}, tensor), big)
    record = RecordSealer(KEY).seal(RecordType.MESSAGE, [encoded.head, encoded.payload])
    back = receive(record, piece=4099, limits=big)
    assert back.meta == {"k": 1} and back.tensor is not None
    assert bytes(back.tensor.data) == payload
    tampered = bytearray(record)
    tampered[-100] ^= 1
    with pytest.raises(FrameError) as error:
        receive(bytes(tampered), piece=4099, limits=big)
    assert error.value.reason == "bad_tag"


def test_a_goodbye_record_ends_the_channel_cleanly_and_silence_does_not() -> None:
    goodbye = RecordSealer(KEY).seal(RecordType.CLOSE, [])
    with pytest.raises(ChannelClosedError) as closed:
        receive(goodbye)
    assert closed.value.clean
    with pytest.raises(ChannelClosedError) as dropped:
        receive(b"")
    assert not dropped.value.clean
    verdict_mid_stream = RecordSealer(KEY).seal(RecordType.VERDICT, [b"\x00\x00\x00"])
    with pytest.raises(FrameError) as error:
        receive(verdict_mid_stream)
    assert error.value.reason == "unexpected_record"
