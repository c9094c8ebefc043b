"""The roster a running node believes, replaced in place when the cluster TOML is reloaded.

Every transport of a node reads its handshakes' roster from one ``RosterBook``; ``update``
hands the new roster to each of them, and each closes its open channels whose peer's key the
new roster no longer lists (``Transport.roster_changed``). So a removed node is refused at its
next handshake and loses the links it holds at the same moment.
"""

from __future__ import annotations

import weakref
from typing import Protocol

from mlxppd.core.config.roster import Roster

__all__ = ["RosterBook", "RosterWatcher"]


class RosterWatcher(Protocol):
    def roster_changed(self, roster: Roster) -> None: ...


class RosterBook:
    """The current roster, and the transports that act on a change of it."""

    def __init__(self, roster: Roster):
        self._roster = roster
        self._watchers: weakref.WeakSet[RosterWatcher] = weakref.WeakSet()

    @property
    def current(self) -> Roster:
        return self._roster

    def watch(self, watcher: RosterWatcher) -> None:
        """Tell ``watcher`` of every later change (held weakly: a closed transport drops out)."""
        self._watchers.add(watcher)

    def update(self, roster: Roster) -> None:
        """Believe ``roster`` from now on; a no-op when it is the same."""
        if roster == self._roster:
            return
        self._roster = roster
        for watcher in list(self._watchers):
            watcher.roster_changed(roster)

    def __repr__(self) -> str:
        return f"RosterBook({len(self._roster)} nodes)"
