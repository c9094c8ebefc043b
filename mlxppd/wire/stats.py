"""Counters of one transport, read by the metrics layer later (no global registry here)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["WireStats"]


@dataclass
class WireStats:
    """Plain counters; keys are ``HandshakeFailure`` / ``FrameRejectReason`` / ``Verdict`` /
    ``PreauthRefusal`` names.

    A tampered verdict is both a rejected frame and a failed handshake, so it shows in both.
    """

    #: connections whose handshake failed, by reason
    handshake_failures: Counter[str] = field(default_factory=Counter)
    #: received frames rejected (each closed its connection), by reason
    rejected_frames: Counter[str] = field(default_factory=Counter)
    #: verdicts this node sent as a server, by verdict name (accepted, at_capacity, refused)
    verdicts_sent: Counter[str] = field(default_factory=Counter)
    #: handshakes that ended with an accepted channel, either role
    channels_established: int = 0
    #: connections a listener closed unread because too many handshakes were in progress
    preauth_refused: Counter[str] = field(default_factory=Counter)
    #: keys this node replaced on its sending side (REKEY records sent)
    rekeys_sent: int = 0
    #: keys peers replaced (REKEY records received and opened)
    rekeys_received: int = 0
    #: open channels closed because their peer's key left the roster
    revoked_channels: int = 0

    def snapshot(self) -> dict[str, object]:
        """A copy safe to hand to another thread or serialize."""
        return {
            "handshake_failures": dict(self.handshake_failures),
            "rejected_frames": dict(self.rejected_frames),
            "verdicts_sent": dict(self.verdicts_sent),
            "channels_established": self.channels_established,
            "preauth_refused": dict(self.preauth_refused),
            "rekeys_sent": self.rekeys_sent,
            "rekeys_received": self.rekeys_received,
            "revoked_channels": self.revoked_channels,
        }
