"""Whether the coordinator serves: one state and its transitions, pure (``runtime/coordinator``
carries them out).

    STARTING --start--> SERVING --lose(recoverable)--> RECOVERING --recover--> SERVING
        |                  |                              |
        +--lose/break------+--lose/break--> DOWN <--give_up+
                           |                 |
                           |                 +--recover--> SERVING (the lost stage came back)
                           |
                           +--restore--> RESTORING --recover--> SERVING (the file's layout)
                                            |  lose(recoverable) --> RECOVERING
                                            +--give_up/lose/break--> DOWN

RESTORING is a failover's layout being undone once the lost nodes serve again: new requests
wait as they do while RECOVERING, running ones finish (or are replayed on the restored
pipeline). Any state --stop--> STOPPED, which is final. A loss seen while DOWN keeps the first
reason (the one an operator needs); a loss seen while RECOVERING or STOPPED is not an event:
the recovery replaces every link anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class ServingState(StrEnum):
    STARTING = "starting"
    """connecting to the stages and warming them"""
    SERVING = "serving"
    """every stage link is up"""
    RECOVERING = "recovering"
    """a stage was lost; requests wait while a new pipeline is found (failover)"""
    RESTORING = "restoring"
    """the lost nodes serve again; new requests wait while the cluster file's layout returns"""
    DOWN = "down"
    """the pipeline is lost (or serves the wrong model); requests fail until it is back"""
    STOPPED = "stopped"
    """the coordinator was closed"""


class ServingEvent(StrEnum):
    START = "start"
    LOSE = "lose"
    """a stage link failed and no failover applies"""
    LOSE_RECOVERABLE = "lose_recoverable"
    """a stage link failed and a failover will look for a new pipeline"""
    RECOVER = "recover"
    """a new pipeline serves (after a failover, or the lost stage came back)"""
    GIVE_UP = "give_up"
    """the failover found no new pipeline"""
    RESTORE = "restore"
    """the nodes a failover left out answer again: the cluster file's layout comes back"""
    BREAK = "break"
    """the stages serve layers that are not the cluster's"""
    STOP = "stop"


class InvalidTransition(ValueError):
    """An event that the state cannot take (a bug in whoever sent it)."""


_S, _E = ServingState, ServingEvent
#: (state, event) -> next state; a pair that is absent is an InvalidTransition
TRANSITIONS: dict[tuple[ServingState, ServingEvent], ServingState] = {
    (_S.STARTING, _E.START): _S.SERVING,
    (_S.STARTING, _E.LOSE): _S.DOWN,
    (_S.STARTING, _E.BREAK): _S.DOWN,
    (_S.SERVING, _E.LOSE): _S.DOWN,
    (_S.SERVING, _E.LOSE_RECOVERABLE): _S.RECOVERING,
    (_S.SERVING, _E.BREAK): _S.DOWN,
    (_S.RECOVERING, _E.RECOVER): _S.SERVING,
    (_S.RECOVERING, _E.GIVE_UP): _S.DOWN,
    (_S.SERVING, _E.RESTORE): _S.RESTORING,
    # A serving stage lost while running requests drain: a failover takes over.
    (_S.RESTORING, _E.LOSE_RECOVERABLE): _S.RECOVERING,
    (_S.RESTORING, _E.LOSE): _S.DOWN,
    (_S.RESTORING, _E.BREAK): _S.DOWN,
    (_S.RESTORING, _E.RECOVER): _S.SERVING,
    (_S.RESTORING, _E.GIVE_UP): _S.DOWN,
    (_S.DOWN, _E.LOSE): _S.DOWN,
    (_S.DOWN, _E.BREAK): _S.DOWN,
    (_S.DOWN, _E.RECOVER): _S.SERVING,
    **{(state, _E.STOP): _S.STOPPED for state in ServingState},
}


@dataclass(frozen=True)
class Serving:
    """The coordinator's serving state, why it is in it, and since when."""

    state: ServingState = ServingState.STARTING
    detail: str = "connecting and warming stages"
    """why: the lost stage, the failover's outcome, ... (one sentence for the health check)"""
    since: float = 0.0
    """when the state was entered, seconds on the caller's clock"""

    def on(self, event: ServingEvent, detail: str, now: float) -> Serving:
        """The state after ``event``; ``detail`` says why (a repeated DOWN keeps its own)."""
        target = TRANSITIONS.get((self.state, event))
        if target is None:
            raise InvalidTransition(f"{self.state.value} cannot take {event.value}")
        if target is self.state and target in (ServingState.DOWN, ServingState.STOPPED):
            return self  # the first reason stays: it is the one an operator needs
        if event is ServingEvent.STOP and self.state is ServingState.RECOVERING:
            detail = "the coordinator stopped during a failover"
        if event is ServingEvent.STOP and self.state is ServingState.RESTORING:
            detail = "the coordinator stopped while restoring the cluster file's layout"
        return replace(self, state=target, detail=detail, since=now)

    @property
    def waits(self) -> bool:
        """New and interrupted requests wait (a failover is finding a new pipeline, or the
        cluster file's layout is coming back)."""
        return self.state in (ServingState.RECOVERING, ServingState.RESTORING)

    @property
    def refuses(self) -> bool:
        """Requests fail now: the pipeline is down, or the coordinator stopped."""
        return self.state in (ServingState.DOWN, ServingState.STOPPED)

    def health_detail(self) -> str:
        """The health check's sentence."""
        if self.state is ServingState.RECOVERING:
            return f"recovering: {self.detail}"
        if self.state is ServingState.RESTORING:
            return f"restoring: {self.detail}"
        if self.state is ServingState.STARTING:
            return f"starting: {self.detail}"
        if self.state is ServingState.SERVING:
            return "all stages connected"
        return self.detail
