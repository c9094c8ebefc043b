"""``[cluster.failover]``: how the coordinator notices a lost stage and how long it may recover.

A table of the cluster TOML (``mlxppd.core.config.cluster`` puts it on ``ClusterSection``); the
coordinator reads it, and standby nodes (role ``"standby"``) are what it recovers onto.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from mlxppd.core.config.messages import KeyedValueError
from mlxppd.core.strict import StrictModel

__all__ = ["MAX_FAILOVER_SECONDS", "FailoverPolicy"]

#: the longest any failover setting may be (seconds): an hour
MAX_FAILOVER_SECONDS = 3600.0


class FailoverPolicy(StrictModel):
    """``[cluster.failover]``: surviving the loss of a stage (docs/operations.md)."""

    enabled: bool = Field(
        True,
        strict=True,
        description="Recover from a lost stage (a standby adopts its layers, or the survivors "
        "share them); false fails the lost stage's requests, as before failover existed.",
    )
    heartbeat_interval_s: float = Field(
        1.0,
        gt=0,
        le=MAX_FAILOVER_SECONDS,
        allow_inf_nan=False,
        strict=True,
        description="Seconds between heartbeats on each coordinator-stage link (0 < x <= 3600).",
    )
    heartbeat_timeout_s: float = Field(
        5.0,
        gt=0,
        le=MAX_FAILOVER_SECONDS,
        allow_inf_nan=False,
        strict=True,
        description="Seconds of silence after which a link's peer counts as lost "
        "(0 < x <= 3600); more than 2 x heartbeat_interval_s.",
    )
    reconnect_grace_s: float = Field(
        10.0,
        gt=0,
        le=MAX_FAILOVER_SECONDS,
        allow_inf_nan=False,
        strict=True,
        description="Seconds the coordinator keeps trying to reach a lost node itself before "
        "turning to a standby or the surviving stages (0 < x <= 3600).",
    )
    recovery_timeout_s: float = Field(
        600.0,
        gt=0,
        le=MAX_FAILOVER_SECONDS,
        allow_inf_nan=False,
        strict=True,
        description="Seconds the whole recovery may take, loading layers included "
        "(0 < x <= 3600); after it the lost stage's requests fail.",
    )
    restore_layout: bool = Field(
        True,
        strict=True,
        description="Once the nodes a standby or the survivors stood in for serve again, put "
        "the cluster file's nodes and layers back by itself (new requests wait meanwhile); "
        "false keeps the failover's layout until a repartition or a restart.",
    )
    restore_after_s: float = Field(
        30.0,
        gt=0,
        le=MAX_FAILOVER_SECONDS,
        allow_inf_nan=False,
        strict=True,
        description="Seconds every returned node must keep answering, with no admissions held "
        "(drain, repartition, reload), before the file's layout is restored; a restore that did "
        "not bring it back doubles the next wait (0 < x <= 3600).",
    )
    restore_drain_s: float = Field(
        30.0,
        gt=0,
        le=MAX_FAILOVER_SECONDS,
        allow_inf_nan=False,
        strict=True,
        description="Seconds running requests may take to finish when the file's layout is "
        "restored; those still running are replayed on the restored pipeline (0 < x <= 3600).",
    )

    @model_validator(mode="after")
    def _timeout_outlasts_two_heartbeats(self) -> FailoverPolicy:
        interval, timeout = self.heartbeat_interval_s, self.heartbeat_timeout_s
        if timeout <= 2 * interval:
            raise KeyedValueError(
                ("heartbeat_timeout_s",),
                f"heartbeat_timeout_s = {timeout:g} s is not more than twice "
                f"heartbeat_interval_s ({interval:g} s), so one late heartbeat would count a "
                f"healthy node as lost; set heartbeat_timeout_s above {2 * interval:g} or lower "
                "heartbeat_interval_s",
            )
        return self
