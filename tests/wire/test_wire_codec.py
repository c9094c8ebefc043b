"""The message codec: tensors as a binary header plus raw bytes, decoded within fixed bounds."""

from __future__ import annotations

import json
import struct
import tracemalloc

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxppd.wire.codec import (
    MESSAGE_HEADER,
    Message,
    MessageAssembler,
    MessageKind,
    Tensor,
    as_tensor,
    decode_message,
    encode_message,
)
from mlxppd.wire.dtypes import DTYPES, dtype_by_code, dtype_by_name, dtype_for_buffer_format
from mlxppd.wire.errors import FrameError, MessageEncodingError
from mlxppd.wire.limits import MAX_NDIM, FrameLimits
from mlxppd.wire.version import PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(120)

LIMITS = FrameLimits()


def roundtrip(message: Message, **kwargs: object) -> Message:
    encoded = encode_message(message, LIMITS)
    return decode_message(encoded.head + bytes(encoded.payload), LIMITS, **kwargs)  # type: ignore[arg-type]


def raw(
    kind: int = 3,
    code: int = 0,
    dims: tuple[int, ...] = (),
    meta: bytes = b"",
    payload: bytes = b"",
    version: int = PROTOCOL_VERSION,
    ndim: int | None = None,
) -> bytes:
    """A message plaintext written by hand, to say exactly what a peer might send."""
    n = len(dims) if ndim is None else ndim
    head = MESSAGE_HEADER.pack(version, kind, code, n, len(meta))
    return head + b"".join(struct.pack(">Q", d) for d in dims) + meta + payload


# -- the dtype table ---------------------------------------------------------------------------


def test_dtype_codes_are_unique_and_names_are_mlx_names() -> None:
    assert len({d.code for d in DTYPES}) == len(DTYPES)
    assert 0 not in {d.code for d in DTYPES}  # 0 means "no tensor"
    for dtype in DTYPES:
        mlx_dtype = getattr(mx, "bool_" if dtype.name == "bool" else dtype.name)
        assert str(mlx_dtype) == f"mlx.core.{dtype.name}"
        assert mlx_dtype.size == dtype.itemsize
        assert dtype_by_code(dtype.code) is dtype
        assert dtype_by_name(dtype.name) is dtype
        assert dtype_by_name(str(mlx_dtype)) is dtype


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d.name != "bfloat16"], ids=str)
def test_numpy_arrays_are_sent_with_their_own_dtype(dtype: object) -> None:
    array = np.arange(24).reshape(2, 3, 4).astype(dtype.storage_name)  # type: ignore[attr-defined]
    tensor = as_tensor(array)
    assert tensor.dtype is dtype and tensor.shape == (2, 3, 4)
    assert np.shares_memory(np.frombuffer(tensor.data, np.uint8), array)  # no copy


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_mlx_arrays_round_trip_through_the_buffer_protocol(dtype: object) -> None:
    """What the engine will do: memoryview(mx_array) out, mx.array(np.frombuffer(...)) in."""
    name = dtype.name  # type: ignore[attr-defined]
    mlx_dtype = getattr(mx, "bool_" if name == "bool" else name)
    array = (mx.arange(12).reshape(3, 4) % 2).astype(mlx_dtype)
    message = roundtrip(Message(MessageKind.ACTIVATION, {}, as_tensor(memoryview(array))))  # type: ignore[arg-type]
    assert message.tensor is not None and message.tensor.dtype is dtype
    storage = np.frombuffer(message.tensor.data, dtype=message.tensor.dtype.storage_name)
    if name == "bfloat16":  # numpy has no bfloat16: its bytes travel as uint16 storage
        back = mx.array(storage.reshape(message.tensor.shape)).view(mx.bfloat16)
    else:
        back = mx.array(storage.reshape(message.tensor.shape), dtype=mlx_dtype)
    assert back.dtype == mlx_dtype and mx.array_equal(back, array).item()


def test_tensor_memory_that_cannot_be_sent_as_is_is_refused_with_a_remedy() -> None:
    with pytest.raises(MessageEncodingError, match="C-contiguous"):
        as_tensor(np.zeros((4, 4), np.float32).T)
    with pytest.raises(MessageEncodingError, match="cannot be sent"):
        as_tensor(np.zeros(3, dtype=">f4"))  # big-endian
    with pytest.raises(MessageEncodingError, match="buffer protocol"):
        as_tensor([1, 2, 3])
    with pytest.raises(MessageEncodingError, match="2-byte"):
        as_tensor(np.zeros(3, np.float32), dtype="bfloat16")
    assert as_tensor(np.zeros(3, np.uint16), dtype="bfloat16").dtype.name == "bfloat16"
    with pytest.raises(ValueError):
        dtype_for_buffer_format("x", 1)


# -- encoding and decoding ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        Message(MessageKind.CONTROL, {"op": "admit", "tokens": [1, 2, 3], "text": "héllo"}),
        Message(MessageKind.REPLY),
        Message(MessageKind.ERROR, {"code": "kv_full"}),
        Message(MessageKind.TOKENS, {"step": 3}, as_tensor(np.array([5, 6], np.int32))),
        Message(MessageKind.ACTIVATION, {}, as_tensor(np.float32(2.5))),  # a scalar
        Message(MessageKind.ACTIVATION, {}, as_tensor(np.zeros((0, 4096), np.float16))),  # empty
    ],
    ids=["control", "bare reply", "error", "tokens", "scalar", "zero-size"],
)
def test_messages_round_trip(message: Message) -> None:
    back = roundtrip(message)
    assert back.kind is message.kind and dict(back.meta) == dict(message.meta)
    if message.tensor is None:
        assert back.tensor is None
    else:
        assert back.tensor is not None
        assert (back.tensor.dtype, back.tensor.shape) == (
            message.tensor.dtype,
            message.tensor.shape,
        )
        assert bytes(back.tensor.data) == bytes(message.tensor.data)


def test_the_header_layout_is_the_documented_one() -> None:
    encoded = encode_message(
        Message(MessageKind.ACTIVATION, {"a": 1}, as_tensor(np.zeros((2, 3), np.float16))), LIMITS
    )
    # 8 + 2 * 8 + 7 = 31 bytes of head: one space of padding aligns the tensor bytes to 16
    assert encoded.head == raw(kind=1, code=10, dims=(2, 3), meta=b'{"a":1} ')
    assert len(encoded.head) % 16 == 0
    assert encoded.payload.nbytes == 12


def test_decoding_uses_the_callers_buffer_when_it_fits_and_fresh_memory_otherwise() -> None:
    message = Message(MessageKind.ACTIVATION, {}, as_tensor(np.arange(100, dtype=np.uint8)))
    big = bytearray(128)
    back = roundtrip(message, into=big)
    assert back.tensor is not None and bytes(big[:100]) == bytes(range(100))
    small = bytearray(10)
    back = roundtrip(message, into=small)
    assert back.tensor is not None and bytes(back.tensor.data) == bytes(range(100))
    assert small == bytearray(10)  # untouched


def test_local_messages_that_cannot_be_encoded_are_refused() -> None:
    with pytest.raises(MessageEncodingError, match="needs a tensor"):
        encode_message(Message(MessageKind.ACTIVATION), LIMITS)
    with pytest.raises(MessageEncodingError, match="not plain JSON"):
        encode_message(Message(MessageKind.CONTROL, {"x": float("nan")}), LIMITS)
    with pytest.raises(MessageEncodingError, match="not plain JSON"):
        encode_message(Message(MessageKind.CONTROL, {"x": object()}), LIMITS)
    # NaN and infinity hide anywhere, next to real nulls, which are fine.
    nested = {"ok": None, "deep": [1, {"v": (2.0, float("-inf"))}]}
    with pytest.raises(MessageEncodingError, match="not plain JSON"):
        encode_message(Message(MessageKind.CONTROL, nested), LIMITS)
    assert roundtrip(Message(MessageKind.CONTROL, {"ok": None, "f": [0.5]})).meta == {
        "ok": None,
        "f": [0.5],
    }
    # Metadata integers are 64-bit (signed or unsigned), as docs/protocol.md says.
    with pytest.raises(MessageEncodingError, match="64-bit"):
        encode_message(Message(MessageKind.CONTROL, {"x": 2**64}), LIMITS)
    edges = {"min": -(2**63), "max": 2**64 - 1}
    assert roundtrip(Message(MessageKind.CONTROL, edges)).meta == edges
    with pytest.raises(MessageEncodingError, match="metadata is 5002 bytes"):
        encode_message(Message(MessageKind.CONTROL, {"x": "y" * 4994}), LIMITS)
    too_many_dims = Tensor(DTYPES[1], (1,) * (MAX_NDIM + 1), memoryview(b"\x00"))
    with pytest.raises(MessageEncodingError, match="dimensions"):
        encode_message(Message(MessageKind.ACTIVATION, {}, too_many_dims), LIMITS)
    wrong_size = Tensor(DTYPES[10], (2, 2), memoryview(b"\x00" * 15))
    with pytest.raises(MessageEncodingError, match="needs 16 bytes"):
        encode_message(Message(MessageKind.ACTIVATION, {}, wrong_size), LIMITS)
    negative = Tensor(DTYPES[1], (-1, -1), memoryview(b"\x00"))
    with pytest.raises(MessageEncodingError, match="negative"):
        encode_message(Message(MessageKind.ACTIVATION, {}, negative), LIMITS)


@pytest.mark.parametrize(
    ("plaintext", "reason"),
    [
        (b"\x01\x03", "size_mismatch"),
        (raw(version=PROTOCOL_VERSION + 1), "unsupported_version"),
        (raw(kind=99), "unknown_kind"),
        (raw(kind=1, code=77, dims=(1,), payload=b"\x00"), "unknown_dtype"),
        (raw(kind=1, code=2, ndim=9, dims=(1,) * 9, payload=b"\x00"), "ndim_exceeds_max"),
        (raw(meta=b" " * 4097), "metadata_exceeds_max"),
        (raw(meta=b"[1, 2]"), "bad_metadata"),
        (raw(meta=b"{bad json"), "bad_metadata"),
        (raw(meta=b'{"x": NaN}'), "bad_metadata"),
        (raw(meta=b"\xff\xfe"), "bad_metadata"),
        (raw(meta=b"[" * 4000), "bad_metadata"),  # deeper than the JSON parser recurses
        (raw(kind=1, code=11, dims=(2, 2), payload=b"\x00" * 15), "size_mismatch"),
        (raw(kind=1, code=11, dims=(2**63, 2**63), payload=b""), "size_mismatch"),
        (raw(kind=3, code=0, ndim=1, dims=(1,)), "size_mismatch"),
        (raw(kind=1), "size_mismatch"),  # an activation without a tensor
        (raw(meta=b"{}") + b"extra", "size_mismatch"),
        (raw(ndim=0, meta=b"x" * 10)[:12], "size_mismatch"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_malformed_messages_are_rejected_with_their_reason(plaintext: bytes, reason: str) -> None:
    with pytest.raises(FrameError) as error:
        decode_message(plaintext, LIMITS)
    assert error.value.reason == reason


# -- properties --------------------------------------------------------------------------------

SMALL_LIMITS = FrameLimits(max_frame_bytes=2048, max_metadata_bytes=256)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.binary(max_size=600)
    | st.builds(
        lambda h, t: h + t,
        st.sampled_from(
            [
                raw(kind=1, code=11, dims=(4,)),
                raw(kind=2, code=8, dims=(2**40,)),
                raw(meta=b'{"a":'),
                raw(kind=1, code=13, dims=(1, 2, 3)),
            ]
        ),
        st.binary(max_size=64),
    )
)
def test_arbitrary_bytes_only_ever_raise_the_codecs_error_within_bounded_memory(
    data: bytes,
) -> None:
    requested: list[int] = []

    def alloc(n: int) -> bytearray:
        requested.append(n)
        return bytearray(n)

    tracemalloc.start()
    try:
        try:
            message = decode_message(data, SMALL_LIMITS, alloc=alloc)
        except FrameError:
            message = None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Tensor memory is never more than the bytes actually present...
    assert all(n <= len(data) for n in requested)
    # ...and nothing else grows with what the header claims (dims up to 2**64).
    assert peak < len(data) + SMALL_LIMITS.max_metadata_bytes + 96 * 1024
    if message is not None and message.tensor is not None:
        assert message.tensor.nbytes <= len(data)


@st.composite
def messages(draw: st.DrawFn) -> Message:
    kind = draw(st.sampled_from(list(MessageKind)))
    meta = draw(
        st.dictionaries(
            st.text(max_size=5), st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8), max_size=4
        )
    )
    needs = kind in (MessageKind.ACTIVATION, MessageKind.TOKENS)
    tensor = None
    if needs or draw(st.booleans()):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        tensor = Tensor(dtype, shape, memoryview(draw(st.binary(min_size=nbytes, max_size=nbytes))))
    return Message(kind, meta, tensor)


@settings(max_examples=200, deadline=None)
@given(messages(), st.lists(st.integers(1, 40), min_size=1, max_size=30))
def test_decoding_piece_by_piece_equals_decoding_at_once(message: Message, cuts: list[int]) -> None:
    encoded = encode_message(message, LIMITS)
    data = encoded.head + bytes(encoded.payload)
    whole = decode_message(data, LIMITS)
    assembler = MessageAssembler(len(data), LIMITS)
    offset, i = 0, 0
    while not assembler.done:
        window = assembler.window()
        n = min(len(window), cuts[i % len(cuts)])
        i += 1
        window[:n] = data[offset : offset + n]
        offset += n
        assembler.advance(n)
    pieces = assembler.finish()
    for back in (whole, pieces):
        assert back.kind is message.kind and dict(back.meta) == json.loads(json.dumps(message.meta))
        if message.tensor is not None:
            assert back.tensor is not None and bytes(back.tensor.data) == bytes(message.tensor.data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.lists(st.integers(1, 64), min_size=1, max_size=20))
def test_arbitrary_bytes_arriving_in_pieces_only_ever_raise_the_codecs_error(
    data: bytes, cuts: list[int]
) -> None:
    """The streaming decoder (large records) holds to the same contract as the one-shot one."""
    requested: list[int] = []

    def alloc(n: int) -> bytearray:
        requested.append(n)
        return bytearray(n)

    assembler = MessageAssembler(len(data), SMALL_LIMITS, alloc=alloc)
    offset, i = 0, 0
    while not assembler.done:
        window = assembler.window()
        n = min(len(window), cuts[i % len(cuts)])
        i += 1
        window[:n] = data[offset : offset + n]
        offset += n
        assembler.advance(n)
    assert offset == len(data)
    try:
        assembler.finish()
    except FrameError:
        pass
    assert all(n <= len(data) for n in requested)
