"""When a failover's layout gives way to the cluster file's again (the coordinator's
``runtime/coordinator/layout_restore.py`` carries it out).

After a standby or the survivors took a lost stage's layers, the pipeline runs on other nodes
than the cluster file names. Once every node of the file's pipeline that it lacks answers
again, and has kept answering for ``after_s`` (a node that flaps is not worth a drain), and
nothing holds admissions (an operator's drain, a repartition, a reload: the pipeline is idle
enough), the coordinator puts the file's layout back: new requests wait, running ones get
``drain_s`` to finish, the rest are replayed on the restored pipeline. Pure: the caller's clock
comes in as ``now``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = ["MAX_WAIT_S", "RestoreWatch", "drain_over", "missing_nodes"]

#: the longest the back-off after failed restores makes a wait, seconds
MAX_WAIT_S = 3600.0


def missing_nodes(serving: Sequence[str], file_nodes: Sequence[str]) -> tuple[str, ...]:
    """The nodes of the file's pipeline that the serving one lacks, in the file's order; empty
    when it runs on the file's nodes (whatever layers they hold: a repartition's are the
    operator's, not a failover's)."""
    if list(serving) == list(file_nodes):
        return ()
    return tuple(node for node in file_nodes if node not in serving)


@dataclass(frozen=True)
class RestoreWatch:
    """Whether the nodes a failover left out have answered long enough to take them back."""

    after_s: float
    """how long every missing node must keep answering, seconds"""
    missing: tuple[str, ...] = ()
    """the nodes watched (the file's pipeline nodes the serving pipeline lacks)"""
    answering_since: float | None = None
    """since when every one of them has answered each look (None: one did not)"""
    failures: int = 0
    """restores of these nodes that did not bring the file's layout back: each doubles the
    wait (a node that answers but cannot serve, another model say, is not retried at once)"""

    @property
    def wait_s(self) -> float:
        """How long the missing nodes must answer before the next restore, seconds."""
        return min(self.after_s * 2.0**self.failures, MAX_WAIT_S)

    def observe(self, missing: tuple[str, ...], answered: bool, now: float) -> RestoreWatch:
        """After a look at ``missing``: ``answered`` when every one of them answered. Another
        set of missing nodes (a second failover) starts the wait, and the back-off, again."""
        if missing != self.missing:
            return RestoreWatch(self.after_s, missing).observe(missing, answered, now)
        if not missing or not answered:
            return replace(self, answering_since=None)
        if self.answering_since is None:
            return replace(self, answering_since=now)
        return self

    def due(self, now: float, held: bool) -> bool:
        """Restore now: every missing node answered for ``wait_s`` and nothing holds
        admissions (``held``: an operator's drain, a repartition, a reload)."""
        if self.answering_since is None or not self.missing or held:
            return False
        return now - self.answering_since >= self.wait_s

    def failed(self) -> RestoreWatch:
        """A restore ran and the nodes are still missing: wait twice as long next time."""
        return replace(self, answering_since=None, failures=self.failures + 1)


def drain_over(active: int, started: float, now: float, drain_s: float) -> bool:
    """The restore's drain ends: nothing runs, or what runs had ``drain_s`` seconds to finish
    (it is replayed on the restored pipeline)."""
    return active == 0 or now - started >= drain_s
