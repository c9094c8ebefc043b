"""Bounds on everything a peer can make this process allocate.

Every length read from the network is compared against these numbers before any memory is
reserved for it; a frame that exceeds them is rejected and its connection closed.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_NDIM", "FrameLimits"]

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
