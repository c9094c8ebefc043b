"""Elastic repartitioning as a pure state machine (docs/elastic.md).

    Idle -> Draining -> Rebalancing -> Resuming -> Idle,  and any step -> Failed

Each function takes the machine and the time and returns the next machine plus the event that
the transition emits (or a rejection). The runtime driver does the work between transitions;
this module only decides what is allowed and records it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from pydantic import ValidationError

from mlxppd.core.config.cluster import ElasticPolicy
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import LayerRange

__all__ = [
    "ElasticMachine",
    "ElasticState",
    "Outcome",
    "Rejection",
    "RepartitionEvent",
    "Trigger",
    "begin",
    "drained",
    "fail",
    "planned",
    "policy_with",
    "pressured_stage",
    "resumed",
]


class ElasticState(enum.StrEnum):
    IDLE = "idle"
    DRAINING = "draining"
    REBALANCING = "rebalancing"
    RESUMING = "resuming"
    FAILED = "failed"


class Trigger(enum.StrEnum):
    EXPLICIT = "explicit"
    """an operator's command; bypasses the cool-down, and the only way out of Failed"""
    MEMORY_PRESSURE = "memory_pressure"
    """a stage's KV cache at or above the pressure fraction"""


class Outcome(enum.StrEnum):
    PROGRESS = "progress"
    COMPLETED = "completed"
    ABORTED = "aborted"
    """stopped before anything changed (the drain timed out)"""
    FAILED = "failed"


class Rejection(enum.StrEnum):
    DISABLED = "disabled"
    BUSY = "busy"
    COOL_DOWN = "cool_down"
    FAILED_NEEDS_EXPLICIT = "failed_needs_explicit"

    def sentence(self) -> str:
        return _REJECTIONS[self]


_REJECTIONS = {
    Rejection.DISABLED: "elastic repartitioning is off; set [cluster.elastic] enabled = true "
    "or pass --enable-elastic-pp",
    Rejection.BUSY: "a repartition is already running; wait for it to finish",
    Rejection.COOL_DOWN: "the last repartition ended less than cool_down_s ago; memory pressure "
    "waits for the cool-down (an explicit trigger does not)",
    Rejection.FAILED_NEEDS_EXPLICIT: "the last repartition failed; only an explicit trigger "
    "(mlxppctl repartition) starts another",
}

_ACTIVE = (ElasticState.DRAINING, ElasticState.REBALANCING, ElasticState.RESUMING)


@dataclass(frozen=True)
class RepartitionEvent:
    """One transition, as the metrics, the log and ``mlxppctl repartition --wait`` see it."""

    trigger: Trigger
    from_state: ElasticState
    to_state: ElasticState
    outcome: Outcome
    ranges_before: tuple[LayerRange, ...]
    ranges_after: tuple[LayerRange, ...] | None
    at: float
    """clock time of the transition (seconds)"""
    phase_s: float
    """seconds spent in ``from_state``"""
    total_s: float
    """seconds since the trigger was accepted"""
    detail: str = ""

    def describe(self) -> str:
        after = _ranges(self.ranges_after) if self.ranges_after is not None else "-"
        text = (
            f"{self.from_state} -> {self.to_state} ({self.outcome}, {self.trigger}) after "
            f"{self.phase_s:.2f} s; layers {_ranges(self.ranges_before)} -> {after}"
        )
        return f"{text}: {self.detail}" if self.detail else text

    def to_dict(self) -> dict[str, object]:
        return {
            "trigger": str(self.trigger),
            "from": str(self.from_state),
            "to": str(self.to_state),
            "outcome": str(self.outcome),
            "ranges_before": _ranges(self.ranges_before),
            "ranges_after": _ranges(self.ranges_after) if self.ranges_after is not None else None,
            "at": self.at,
            "phase_s": self.phase_s,
            "total_s": self.total_s,
            "detail": self.detail,
        }


def _ranges(ranges: Sequence[LayerRange]) -> str:
    return ",".join(f"{r.start}-{r.last}" for r in ranges)


@dataclass(frozen=True)
class ElasticMachine:
    policy: ElasticPolicy
    ranges: tuple[LayerRange, ...]
    """the layer ranges in force"""
    state: ElasticState = ElasticState.IDLE
    trigger: Trigger | None = None
    started_at: float = 0.0
    entered_at: float = 0.0
    target: tuple[LayerRange, ...] | None = None
    finished_at: float | None = None
    """when the last repartition ended (completed, aborted or failed): the cool-down's start"""

    def _event(
        self, to: ElasticState, outcome: Outcome, now: float, detail: str = ""
    ) -> RepartitionEvent:
        assert self.trigger is not None
        return RepartitionEvent(
            trigger=self.trigger,
            from_state=self.state,
            to_state=to,
            outcome=outcome,
            ranges_before=self.ranges,
            ranges_after=self.target,
            at=now,
            phase_s=now - self.entered_at,
            total_s=now - self.started_at,
            detail=detail,
        )


Step = tuple[ElasticMachine, RepartitionEvent]


def begin(m: ElasticMachine, trigger: Trigger, now: float) -> Step | Rejection:
    """Accept a trigger (-> Draining) or say why not."""
    if not m.policy.enabled:
        return Rejection.DISABLED
    if m.state in _ACTIVE:
        return Rejection.BUSY
    if m.state is ElasticState.FAILED and trigger is not Trigger.EXPLICIT:
        return Rejection.FAILED_NEEDS_EXPLICIT
    cooling = m.finished_at is not None and now - m.finished_at < m.policy.cool_down_s
    if trigger is Trigger.MEMORY_PRESSURE and cooling:
        return Rejection.COOL_DOWN
    started = replace(m, trigger=trigger, started_at=now, entered_at=now, target=None)
    event = started._event(ElasticState.DRAINING, Outcome.PROGRESS, now)
    return replace(started, state=ElasticState.DRAINING), event


def _expect(m: ElasticMachine, state: ElasticState) -> None:
    if m.state is not state:
        raise ValueError(f"the machine is {m.state}, not {state}")


def drained(m: ElasticMachine, now: float) -> Step:
    """Every stage reports no sequence in flight: Draining -> Rebalancing."""
    _expect(m, ElasticState.DRAINING)
    event = m._event(ElasticState.REBALANCING, Outcome.PROGRESS, now)
    return replace(m, state=ElasticState.REBALANCING, entered_at=now), event


def planned(m: ElasticMachine, target: tuple[LayerRange, ...], now: float) -> Step:
    """A validated plan: Rebalancing -> Resuming."""
    _expect(m, ElasticState.REBALANCING)
    with_target = replace(m, target=target)
    event = with_target._event(ElasticState.RESUMING, Outcome.PROGRESS, now)
    return replace(with_target, state=ElasticState.RESUMING, entered_at=now), event


def resumed(m: ElasticMachine, now: float) -> Step:
    """Every stage serves the new plan: Resuming -> Idle, the new ranges in force."""
    _expect(m, ElasticState.RESUMING)
    assert m.target is not None
    event = m._event(ElasticState.IDLE, Outcome.COMPLETED, now)
    done = replace(
        m, state=ElasticState.IDLE, entered_at=now, ranges=m.target, target=None, finished_at=now
    )
    return done, event


def fail(m: ElasticMachine, reason: str, now: float, *, aborted: bool = False) -> Step:
    """Any step -> Failed; the previous ranges stay in force."""
    if m.state not in _ACTIVE:
        raise ValueError(f"nothing to fail: the machine is {m.state}")
    outcome = Outcome.ABORTED if aborted else Outcome.FAILED
    event = m._event(ElasticState.FAILED, outcome, now, reason)
    return replace(
        m, state=ElasticState.FAILED, entered_at=now, target=None, finished_at=now
    ), event


def pressured_stage(usage: Sequence[tuple[int, int, int | None]], fraction: float) -> int | None:
    """The first stage whose KV use is at or above ``fraction`` of its budget, from
    (stage, used bytes, budget bytes or None = unlimited) triples."""
    for stage, used, budget in usage:
        if budget and used >= fraction * budget:
            return stage
    return None


_FLAGS = {
    "enabled": "--enable-elastic-pp",
    "drain_timeout_s": "--elastic-pp-drain-timeout",
    "pressure_fraction": "--elastic-pp-pressure-fraction",
    "cool_down_s": "--elastic-pp-cool-down",
}


def policy_with(policy: ElasticPolicy, overrides: Mapping[str, object]) -> ElasticPolicy:
    """``[cluster.elastic]`` with the command line's elastic flags (None: not given) on top."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return policy
    try:
        return ElasticPolicy.model_validate({**policy.model_dump(), **given})
    except ValidationError as exc:
        first = exc.errors()[0]
        flag = _FLAGS.get(str(first["loc"][0]), str(first["loc"][0]))
        raise ConfigurationError(str(first["msg"]), source=flag) from None
