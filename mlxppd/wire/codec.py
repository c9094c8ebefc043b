"""The message codec: what one authenticated record carries once decrypted.

Layout (all integers big-endian; docs/protocol.md, "Messages")::

    u8  version        PROTOCOL_VERSION
    u8  kind           MessageKind
    u8  dtype          DType code, 0 = no tensor
    u8  ndim           0..MAX_NDIM (0 when there is no tensor)
    u32 meta_len       0..max_metadata_bytes
    u64 shape[ndim]
    meta_len bytes     metadata: a UTF-8 JSON object (small control data only, never tensors;
                       integers within 64 bits, no NaN or Infinity),
                       padded with spaces so the tensor bytes start 16-byte aligned
    ...                tensor bytes, exactly prod(shape) * itemsize, C order, little-endian

Two decoders run the same checks: ``decode_message`` takes a whole plaintext (small records,
opened in one call), ``MessageAssembler`` takes one that arrives piece by piece (large records),
so the record layer can decrypt straight into the memory the tensor will live in: the small head
goes into a bounded scratch buffer, the tensor bytes into a buffer the caller supplies (``into``)
or one allocated at the exact, already bounded, size. Nothing is ever unpickled or evaluated.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from mlxppd.wire.dtypes import DType, dtype_by_code, dtype_by_name, dtype_for_buffer_format
from mlxppd.wire.errors import FrameError, FrameRejectReason, MessageEncodingError
from mlxppd.wire.limits import MAX_NDIM, Alloc, FrameLimits, received_buffer
from mlxppd.wire.version import PROTOCOL_VERSION

__all__ = [
    "MESSAGE_HEADER",
    "EncodedMessage",
    "Message",
    "MessageAssembler",
    "MessageKind",
    "Tensor",
    "as_tensor",
    "decode_message",
    "encode",
    "encode_message",
    "encode_parts",
    "metadata_bytes",
]

#: version, kind, dtype code, ndim, metadata length
MESSAGE_HEADER = struct.Struct(">BBBBI")
_DIM = struct.Struct(">Q")
# The fixed header and the shape of an n-dimensional tensor, packed or read in one call.
_HEADS = tuple(struct.Struct(f">BBBBI{n}Q") for n in range(MAX_NDIM + 1))
_SHAPES = tuple(struct.Struct(f">{n}Q") for n in range(MAX_NDIM + 1))
_ALIGN = 16
_SPACES = tuple(b" " * n for n in range(_ALIGN))
# Metadata is JSON through orjson: 3-6x faster than the json module both ways, about 1 µs of
# every decode step. Options make it write what json would: int, float, bool and None keys as
# strings, and it refuses dataclasses and datetimes as json does instead of converting them.
_JSON_OPTIONS = (
    orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME
)


def _json_bytes(meta: Mapping[str, Any]) -> bytes:
    obj = meta if type(meta) is dict else dict(meta)
    raw: bytes = orjson.dumps(obj, option=_JSON_OPTIONS)
    if b"null" in raw:  # orjson writes NaN and infinity as null; they are not JSON
        _refuse_non_finite(obj)
    return raw


def metadata_bytes(meta: Mapping[str, Any]) -> int:
    """How many bytes ``meta`` takes in a message (before its alignment padding): what
    ``max_metadata_bytes`` bounds."""
    return len(_json_bytes(meta))


def _refuse_non_finite(value: object) -> None:
    if type(value) is float:
        if not math.isfinite(value):
            raise ValueError(f"{value} is not a JSON number")
    elif isinstance(value, dict):
        for item in value.values():
            _refuse_non_finite(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _refuse_non_finite(item)


# After a malformed head the rest of the record still has to be decrypted (to tell tampering
# from a bad authentic message); it is decrypted into this much reusable scratch at a time.
_DISCARD_CHUNK = 64 * 1024


class MessageKind(enum.IntEnum):
    """What a message is for; wire values are fixed (docs/protocol.md)."""

    ACTIVATION = 1  # hidden states handed from one stage to the next (tensor required)
    TOKENS = 2  # sampled token ids (and logprobs) relayed back (tensor required)
    CONTROL = 3  # a command; its arguments are the metadata
    REPLY = 4  # the answer to a command
    ERROR = 5  # a typed failure report


_NEEDS_TENSOR = frozenset({MessageKind.ACTIVATION, MessageKind.TOKENS})
_KINDS = {k.value: k for k in MessageKind}


# Value classes are slotted, non-frozen dataclasses: they are created several times per message
# on the decode-step hot path, where a frozen dataclass costs twice as much. Treat them as values.
@dataclass(slots=True)
class Tensor:
    """A dense C-order tensor as raw bytes: ``data`` is a byte-format memoryview.

    Checked when encoded (``encode_message``), not when made, so decoding stays cheap.
    """

    dtype: DType
    shape: tuple[int, ...]
    data: memoryview

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _check_tensor(tensor: Tensor) -> None:
    shape = tensor.shape
    if len(shape) > MAX_NDIM:
        raise MessageEncodingError(
            f"tensor has {len(shape)} dimensions; at most {MAX_NDIM} can be sent"
        )
    if shape and min(shape) < 0:
        raise MessageEncodingError(f"tensor shape {shape} has a negative dimension")
    if tensor.data.nbytes != tensor.nbytes:
        raise MessageEncodingError(
            f"tensor of shape {shape} and dtype {tensor.dtype.name} needs "
            f"{tensor.nbytes} bytes, but its buffer has {tensor.data.nbytes}"
        )


_FORMAT_CACHE: dict[tuple[str, int], DType] = {}


def as_tensor(obj: object, dtype: DType | str | None = None) -> Tensor:
    """A ``Tensor`` over the memory of any buffer-protocol object, without copying it.

    numpy arrays and ``memoryview(mlx_array)`` both work. The element type comes from the
    buffer's format unless ``dtype`` is given (needed e.g. to send numpy uint16 as bfloat16).
    """
    if type(obj) is Tensor:
        return obj
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise MessageEncodingError(
            f"a {type(obj).__name__} does not expose the buffer protocol; "
            "pass a numpy array, memoryview(mlx_array) or a Tensor"
        ) from None
    if not view.c_contiguous:
        raise MessageEncodingError(
            "tensor memory is not C-contiguous; send a contiguous copy "
            "(np.ascontiguousarray or mx.contiguous)"
        )
    key = (view.format, view.itemsize)
    resolved = _FORMAT_CACHE.get(key) if dtype is None else None
    if resolved is None:
        try:
            if dtype is None:
                resolved = _FORMAT_CACHE[key] = dtype_for_buffer_format(*key)
            else:
                resolved = dtype if isinstance(dtype, DType) else dtype_by_name(dtype)
        except ValueError as exc:
            raise MessageEncodingError(str(exc)) from None
    if resolved.itemsize != view.itemsize:
        raise MessageEncodingError(
            f"dtype {resolved.name} has {resolved.itemsize}-byte elements but the buffer's "
            f"elements are {view.itemsize} bytes"
        )
    # memoryview refuses to cast a view with a zero in its shape; an empty tensor has no bytes.
    data = view.cast("B") if view.nbytes else memoryview(b"")
    return Tensor(resolved, view.shape or (), data)


@dataclass(slots=True)
class Message:
    """One decoded (or to-be-encoded) message."""

    kind: MessageKind
    meta: Mapping[str, Any] = field(default_factory=dict)
    tensor: Tensor | None = None


@dataclass(slots=True)
class EncodedMessage:
    """A message ready for the record layer: a small ``head`` and the tensor bytes, unjoined."""

    head: bytes
    payload: memoryview

    @property
    def length(self) -> int:
        return len(self.head) + self.payload.nbytes


_NO_PAYLOAD = memoryview(b"")


def encode_message(message: Message, limits: FrameLimits) -> EncodedMessage:
    """Lay out ``message``; the tensor bytes are referenced, never copied."""
    return encode(message.kind, message.meta, message.tensor, limits)


def encode(
    kind: MessageKind, meta: Mapping[str, Any] | None, tensor: Tensor | None, limits: FrameLimits
) -> EncodedMessage:
    """``encode_message`` without building a Message first."""
    return EncodedMessage(*encode_parts(kind, meta, tensor, limits))


def encode_parts(
    kind: MessageKind, meta: Mapping[str, Any] | None, tensor: Tensor | None, limits: FrameLimits
) -> tuple[bytes, memoryview]:
    """``encode`` as its two parts, the head and the tensor bytes (the channel's send path)."""
    raw = b""
    if meta:
        try:
            raw = _json_bytes(meta)
        except (TypeError, ValueError, RecursionError) as exc:
            raise MessageEncodingError(f"message metadata is not plain JSON: {exc}") from None
        if len(raw) > limits.max_metadata_bytes:
            raise MessageEncodingError(
                f"message metadata is {len(raw)} bytes; the limit is {limits.max_metadata_bytes}"
            )
    if tensor is None:
        if kind in _NEEDS_TENSOR:
            raise MessageEncodingError(f"a {kind.name} message needs a tensor")
        return MESSAGE_HEADER.pack(PROTOCOL_VERSION, kind, 0, 0, len(raw)) + raw, _NO_PAYLOAD
    shape = tensor.shape
    ndim = len(shape)
    data = tensor.data
    dtype = tensor.dtype
    nbytes = data.nbytes
    if ndim > MAX_NDIM or nbytes != math.prod(shape) * dtype.itemsize or (ndim and min(shape) < 0):
        _check_tensor(tensor)  # raises, saying which
    # Pad the metadata with JSON whitespace so the tensor bytes start 16-byte aligned in the
    # plaintext, which a receiver may hand on as is (numpy, mlx and memcpy prefer that).
    pad = -(MESSAGE_HEADER.size + _DIM.size * ndim + len(raw)) % _ALIGN
    if pad and len(raw) + pad <= limits.max_metadata_bytes:
        raw += _SPACES[pad]
    head = _HEADS[ndim].pack(PROTOCOL_VERSION, kind, dtype.code, ndim, len(raw), *shape) + raw
    if len(head) + nbytes > limits.max_frame_bytes:
        raise MessageEncodingError(
            f"message is {len(head) + nbytes} bytes; the frame limit is {limits.max_frame_bytes} "
            "(raise max_frame_bytes on every node, or split the tensor)"
        )
    return head, data


class _Phase(enum.Enum):
    FIXED = 1  # the 8-byte fixed header
    HEAD = 2  # shape and metadata
    PAYLOAD = 3  # tensor bytes
    DISCARD = 4  # the rest of a record whose head was malformed
    DONE = 5


class MessageAssembler:
    """Receives the ``length`` plaintext bytes of one message record into their final memory.

    Drive it with ``window()`` (where the next bytes go) and ``advance(n)`` (``n`` bytes were
    written there), then call ``finish()`` once the record is authenticated. A malformed head
    does not raise at once: the remaining bytes are swallowed so the caller can still check the
    record's tag, and ``finish()`` raises then. Every allocation is bounded by ``length``, which
    the caller has already bounded by ``limits.max_frame_bytes``; the tensor's memory is only
    reserved once the head passed its checks, and is committed as its bytes arrive.
    """

    def __init__(
        self,
        length: int,
        limits: FrameLimits,
        *,
        into: object | None = None,
        alloc: Alloc = received_buffer,
    ):
        self._limits = limits
        self._length = length
        self._into = into
        self._alloc = alloc
        self._consumed = 0
        self._error: FrameError | None = None
        self._fixed = bytearray(MESSAGE_HEADER.size)
        self._fields: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
        self._head = bytearray()
        self._payload = memoryview(b"")
        self._target = memoryview(self._fixed)
        self._pos = 0
        self._phase = _Phase.FIXED
        if length > limits.max_frame_bytes:
            self._fail(
                FrameError(FrameRejectReason.LENGTH_EXCEEDS_MAX, f"{length} B over the limit")
            )
        elif length < MESSAGE_HEADER.size:
            self._fail(FrameError(FrameRejectReason.SIZE_MISMATCH, f"{length} B hold no header"))

    @property
    def done(self) -> bool:
        return self._phase is _Phase.DONE

    def window(self) -> memoryview:
        """Writable memory for the next plaintext bytes (empty once every byte has arrived)."""
        return self._target[self._pos :]

    def advance(self, n: int) -> None:
        """Record that the first ``n`` bytes of ``window()`` now hold plaintext."""
        if not 0 <= n <= len(self._target) - self._pos:
            raise ValueError("advance() past the current window")
        self._pos += n
        self._consumed += n
        if self._pos == len(self._target) and self._phase is not _Phase.DONE:
            self._next_phase()

    def finish(self) -> Message:
        """The message, once all bytes arrived and the record was authenticated."""
        if self._error is not None:
            raise self._error
        if not self.done:
            raise FrameError(FrameRejectReason.TRUNCATED, "the message ended early")
        _, kind, code, _, _ = self._fields
        meta = _parse_metadata(bytes(self._head[len(self._head) - self._fields[4] :]))
        tensor = None
        dtype = dtype_by_code(code)
        if dtype is not None:
            tensor = Tensor(dtype, self._shape(), self._payload)
        return Message(_KINDS[kind], meta, tensor)

    # -- phases ---------------------------------------------------------------------------

    def _fail(self, error: FrameError) -> None:
        self._error = error
        self._phase = _Phase.DISCARD
        self._set_discard_target()

    def _set_discard_target(self) -> None:
        remaining = self._length - self._consumed
        if remaining <= 0:
            self._phase = _Phase.DONE
            self._target, self._pos = memoryview(b""), 0
            return
        if len(self._target) < min(remaining, _DISCARD_CHUNK) or self._target.readonly:
            self._target = memoryview(bytearray(min(remaining, _DISCARD_CHUNK)))
        self._target, self._pos = self._target[: min(remaining, _DISCARD_CHUNK)], 0

    def _next_phase(self) -> None:
        if self._phase is _Phase.FIXED:
            self._after_fixed()
        elif self._phase is _Phase.HEAD:
            self._after_head()
        elif self._phase is _Phase.PAYLOAD:
            self._phase = _Phase.DONE
            self._target, self._pos = memoryview(b""), 0
        elif self._phase is _Phase.DISCARD:
            self._set_discard_target()

    def _after_fixed(self) -> None:
        self._fields = MESSAGE_HEADER.unpack(self._fixed)
        error = _check_fixed(self._fields, self._length, self._limits)
        if error is not None:
            return self._fail(error)
        _, _, _, ndim, meta_len = self._fields
        head_len = _DIM.size * ndim + meta_len
        self._head = bytearray(head_len)  # bounded: 8 * MAX_NDIM + max_metadata_bytes
        self._phase, self._target, self._pos = _Phase.HEAD, memoryview(self._head), 0
        if head_len == 0:
            self._after_head()

    def _after_head(self) -> None:
        dtype, error = _check_payload(self._fields[2], self._shape(), self._length - self._consumed)
        if error is not None:
            return self._fail(error)
        nbytes = self._length - self._consumed
        self._payload = _destination(nbytes, self._into, self._alloc)
        self._phase, self._target, self._pos = _Phase.PAYLOAD, self._payload, 0
        if nbytes == 0:
            self._next_phase()

    def _shape(self) -> tuple[int, ...]:
        ndim = self._fields[3]
        return _SHAPES[ndim].unpack_from(self._head) if ndim else ()


def _parse_metadata(raw: bytes | memoryview) -> dict[str, Any]:
    try:
        value = orjson.loads(raw)  # bounded depth; NaN, Infinity and bad UTF-8 are errors
    except orjson.JSONDecodeError as exc:
        if not bytes(raw).strip(b" "):  # none, or only the alignment padding
            return {}
        raise FrameError(FrameRejectReason.BAD_METADATA, f"metadata is not JSON: {exc}") from None
    if type(value) is not dict:
        raise FrameError(FrameRejectReason.BAD_METADATA, "metadata is not a JSON object")
    return value


def _check_fixed(fields: tuple[int, ...], length: int, limits: FrameLimits) -> FrameError | None:
    """Check the fixed header against the record length and the limits (pure)."""
    version, kind, code, ndim, meta_len = fields
    if version != PROTOCOL_VERSION:
        return FrameError(
            FrameRejectReason.UNSUPPORTED_VERSION,
            f"message version {version}, not {PROTOCOL_VERSION}",
        )
    if kind not in _KINDS:
        return FrameError(FrameRejectReason.UNKNOWN_KIND, f"message kind {kind}")
    if code != 0 and dtype_by_code(code) is None:
        return FrameError(FrameRejectReason.UNKNOWN_DTYPE, f"dtype code {code}")
    if ndim > MAX_NDIM:
        return FrameError(FrameRejectReason.NDIM_EXCEEDS_MAX, f"{ndim} dimensions")
    if code == 0 and ndim != 0:
        return FrameError(FrameRejectReason.SIZE_MISMATCH, "a shape without a dtype")
    if code == 0 and _KINDS[kind] in _NEEDS_TENSOR:
        return FrameError(
            FrameRejectReason.SIZE_MISMATCH, f"a {_KINDS[kind].name} without a tensor"
        )
    if meta_len > limits.max_metadata_bytes:
        return FrameError(FrameRejectReason.METADATA_EXCEEDS_MAX, f"{meta_len} metadata bytes")
    if MESSAGE_HEADER.size + _DIM.size * ndim + meta_len > length:
        return FrameError(FrameRejectReason.SIZE_MISMATCH, "the head is longer than the record")
    return None


def _check_payload(
    code: int, shape: tuple[int, ...], present: int
) -> tuple[DType | None, FrameError | None]:
    """The dtype, or why ``present`` tensor bytes do not fit ``shape`` (pure)."""
    dtype = dtype_by_code(code)
    nbytes = math.prod(shape) * dtype.itemsize if dtype else 0
    if nbytes != present:
        detail = f"shape {shape} needs {nbytes} tensor bytes, the record has {present}"
        return dtype, FrameError(FrameRejectReason.SIZE_MISMATCH, detail)
    return dtype, None


def _destination(nbytes: int, into: object | None, alloc: Alloc) -> memoryview:
    """Where ``nbytes`` of tensor data go: the caller's buffer if it fits, else fresh memory."""
    if into is not None:
        try:
            view = memoryview(into).cast("B")  # type: ignore[arg-type]
        except (TypeError, ValueError):
            view = None
        # A caller buffer that cannot take the tensor is a local matter, never the peer's
        # fault: fall back to fresh memory rather than failing the frame.
        if view is not None and not view.readonly and view.nbytes >= nbytes:
            return view[:nbytes]
    return memoryview(alloc(nbytes))


def decode_message(
    data: object,
    limits: FrameLimits,
    *,
    into: object | None = None,
    alloc: Callable[[int], bytearray] = bytearray,
) -> Message:
    """Decode one whole, already authenticated, message plaintext.

    The tensor bytes land in ``into`` when it fits; otherwise, when ``data`` is writable memory
    this process owns (a decrypted bytearray), the tensor is a view of it, without a copy.
    """
    src = data if type(data) is memoryview else memoryview(data)  # type: ignore[arg-type]
    if src.format != "B" or src.ndim != 1:
        src = src.cast("B")
    length = src.nbytes
    if length < MESSAGE_HEADER.size:
        raise FrameError(FrameRejectReason.SIZE_MISMATCH, f"{length} B hold no header")
    fields = MESSAGE_HEADER.unpack_from(src)
    version, kind, code, ndim, meta_len = fields
    dtype = dtype_by_code(code)
    shape_end = MESSAGE_HEADER.size + _DIM.size * ndim
    head_len = shape_end + meta_len
    # One test for what every well-formed message satisfies; the named checks run only when
    # it fails, so they stay the single place that says what is wrong.
    if not (
        version == PROTOCOL_VERSION
        and kind in _KINDS
        and ndim <= MAX_NDIM
        and meta_len <= limits.max_metadata_bytes
        and head_len <= length
        and (dtype is not None or (code == 0 and ndim == 0 and kind not in _NEEDS_TENSOR))
    ):
        error = _check_fixed(fields, length, limits)
        if error is not None:
            raise error
    shape = _SHAPES[ndim].unpack_from(src, MESSAGE_HEADER.size) if ndim else ()
    if (math.prod(shape) * dtype.itemsize if dtype else 0) != length - head_len:
        _, error = _check_payload(code, shape, length - head_len)
        if error is not None:
            raise error
    meta = _parse_metadata(src[shape_end:head_len]) if meta_len else {}
    if dtype is None:
        return Message(_KINDS[kind], meta)
    present = src[head_len:]
    if into is None and not src.readonly:
        payload = present
    else:
        payload = _destination(length - head_len, into, alloc)
        payload[:] = present
    return Message(_KINDS[kind], meta, Tensor(dtype, shape, payload))
