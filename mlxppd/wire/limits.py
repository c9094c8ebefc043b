"""Bounds on everything a peer can make this process allocate.

Every length read from the network is compared against these numbers before any memory is
reserved for it; a frame that exceeds them is rejected and its connection closed.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["LAZY_BUFFER_BYTES", "MAX_NDIM", "Alloc", "FrameLimits", "received_buffer"]

#: Most tensor dimensions a message may declare (activations are at most 4-D in practice).
MAX_NDIM = 8

# Hard ceilings the configurable limits may not exceed: the record length is a u32 that also
# covers the 16-byte tag, and the metadata length must stay small enough to parse eagerly.
_RECORD_LENGTH_CEILING = 2**32 - 1 - 16
_METADATA_CEILING = 64 * 1024


@dataclass(frozen=True)
class FrameLimits:
    """Per-connection bounds; the defaults fit a 32k-token prefill of a 8192-wide fp16 model."""

    #: Most plaintext bytes in one record (message header + metadata + tensor bytes).
    max_frame_bytes: int = 256 * 1024 * 1024
    #: Most bytes of JSON metadata in one message.
    max_metadata_bytes: int = 4096

    def __post_init__(self) -> None:
        if not 1024 <= self.max_frame_bytes <= _RECORD_LENGTH_CEILING:
            raise ValueError(
                f"max_frame_bytes must be between 1024 and {_RECORD_LENGTH_CEILING}, "
                f"not {self.max_frame_bytes}"
            )
        if not 0 <= self.max_metadata_bytes <= min(_METADATA_CEILING, self.max_frame_bytes):
            raise ValueError(
                f"max_metadata_bytes must be between 0 and {_METADATA_CEILING} and at most "
                f"max_frame_bytes, not {self.max_metadata_bytes}"
            )


#: Received tensors at least this large go into memory the OS commits page by page as bytes
#: are written (an anonymous mapping), not memory zeroed up front.
LAZY_BUFFER_BYTES = 1024 * 1024

#: Makes fresh writable memory of a given size for received tensor bytes.
Alloc = Callable[[int], bytearray | mmap.mmap]


def received_buffer(n: int) -> bytearray | mmap.mmap:
    """Fresh writable memory for ``n`` bytes of a tensor being received.

    A large record's tag is only checked after its last byte, so the buffer is allocated while
    its length is still unauthenticated: as a lazily committed mapping it costs address space,
    and resident memory only for the bytes that actually arrive.
    """
    if n >= LAZY_BUFFER_BYTES:
        return mmap.mmap(-1, n)
    return bytearray(n)
