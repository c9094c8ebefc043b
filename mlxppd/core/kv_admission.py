"""Per-stage KV cache accounting and coordinated admission (dry run everywhere, then commit).

A sequence is admitted only if every stage can hold its KV cache for the whole request
(prompt plus the most tokens it may generate); otherwise nothing is committed anywhere and the
rejecting stage's diagnostic says why. A tensor-parallel stage is several (stage, rank) slots,
each holding its shard of the KV heads against its own budget: its ``SlotKvManager``
dry-runs every slot and commits on all only if all accept (coordinated 2D admission), and a
refusal names its slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

#: the budget of a stage with no KV budget configured: one that never binds
UNLIMITED_BYTES = 1 << 62
#: sequences a stage holds KV for unless configured (serve --max-batch-size, mlxppd.toml
#: max_sequences); matches the coordinator's default --parallel, so neither waits on the other
DEFAULT_STAGE_SEQUENCES = 64


class RejectReason(StrEnum):
    MEMORY = "memory"
    SEQUENCE_CAP = "sequence_cap"
    ALREADY_CACHED = "already_cached"
    REJECTED_BY_STAGE = "rejected_by_stage"
    DRAINING = "draining"
    PLAN_MISMATCH = "plan_mismatch"
    #: the stage cannot serve the request's parameters (e.g. its sampler refuses them)
    INVALID_REQUEST = "invalid_request"


@dataclass(frozen=True)
class AdmissionRequest:
    sequence_id: str
    prompt_tokens: int
    max_new_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.max_new_tokens


@dataclass(frozen=True)
class AdmissionDiagnostic:
    """Why a stage said no, with its accounting at that moment (bytes)."""

    stage_index: int
    reason: RejectReason
    required_bytes: int
    used_memory_bytes: int
    budget_bytes: int
    active_sequences: int
    rank: int | None = None
    """the tensor-parallel rank of the refusing slot (None: a stage of one rank)"""

    @property
    def where(self) -> str:
        """The refusing slot, as a sentence names it."""
        if self.rank is None:
            return f"stage {self.stage_index}"
        return f"stage {self.stage_index} rank {self.rank}"

    @property
    def available_bytes(self) -> int:
        return max(0, self.budget_bytes - self.used_memory_bytes)

    @property
    def never_fits(self) -> bool:
        """More than the stage's whole budget: retrying cannot help, the request must shrink."""
        return self.reason is RejectReason.MEMORY and self.required_bytes > self.budget_bytes

    def message(self) -> str:
        if self.never_fits:
            return (
                f"this request needs {self.required_bytes} KV bytes on {self.where}, "
                f"more than its whole budget of {self.budget_bytes}; shorten the prompt or "
                "max_tokens"
            )
        if self.reason is RejectReason.MEMORY:
            return (
                f"{self.where} has {self.available_bytes} of {self.budget_bytes} KV "
                f"bytes free but this request needs {self.required_bytes}; shorten the prompt or "
                "max_tokens, or retry when other requests finish"
            )
        if self.reason is RejectReason.SEQUENCE_CAP:
            return (
                f"{self.where} already holds {self.active_sequences} sequences, its "
                "limit; retry shortly"
            )
        if self.reason is RejectReason.DRAINING:
            return (
                f"{self.where} is draining (a reload or shutdown); retry after Retry-After seconds"
            )
        if self.reason is RejectReason.PLAN_MISMATCH:
            return (
                f"{self.where} holds other layers than the coordinator expects "
                "(the cluster is changing its layer ranges); retry after Retry-After seconds"
            )
        if self.reason is RejectReason.INVALID_REQUEST:
            return f"{self.where} cannot serve this request's sampling parameters"
        if self.reason is RejectReason.ALREADY_CACHED:
            return f"{self.where} already holds this sequence id"
        return f"{self.where} refused the sequence"


@dataclass
class StageKvManager:
    """The KV budget of one stage: ``bytes_per_token`` covers every layer the stage owns."""

    stage_index: int
    budget_bytes: int
    bytes_per_token: int
    max_sequences: int = 1 << 30
    reserved: dict[str, int] = field(default_factory=dict)
    rank: int | None = None
    """the tensor-parallel rank this accounting is for (None: a stage of one rank)"""
    #: prompt-cache entries the stage keeps for the coordinator: entry id -> bytes
    pinned: dict[str, int] = field(default_factory=dict)

    @property
    def used_bytes(self) -> int:
        return sum(self.reserved.values()) + sum(self.pinned.values())

    def pin(self, entry: str, tokens: int) -> None:
        """Count a kept prefix of ``tokens`` against the budget until it is unpinned."""
        self.pinned[entry] = tokens * self.bytes_per_token

    def unpin(self, entry: str) -> None:
        self.pinned.pop(entry, None)

    def required_bytes(self, request: AdmissionRequest) -> int:
        return request.total_tokens * self.bytes_per_token

    def dry_run(self, request: AdmissionRequest) -> AdmissionDiagnostic | None:
        """None if the request fits now; otherwise the reason it does not."""
        required = self.required_bytes(request)
        reason = None
        if request.sequence_id in self.reserved:
            reason = RejectReason.ALREADY_CACHED
        elif len(self.reserved) >= self.max_sequences:
            reason = RejectReason.SEQUENCE_CAP
        elif self.used_bytes + required > self.budget_bytes:
            reason = RejectReason.MEMORY
        return None if reason is None else self.refusal(reason, required)

    def refusal(self, reason: RejectReason, required_bytes: int = 0) -> AdmissionDiagnostic:
        """A refusal for ``reason``, with this stage's accounting at this moment."""
        return AdmissionDiagnostic(
            stage_index=self.stage_index,
            reason=reason,
            required_bytes=required_bytes,
            used_memory_bytes=self.used_bytes,
            budget_bytes=self.budget_bytes,
            active_sequences=len(self.reserved),
            rank=self.rank,
        )

    def commit(self, request: AdmissionRequest) -> None:
        problem = self.dry_run(request)
        if problem is not None:
            raise ValueError(problem.message())
        self.reserved[request.sequence_id] = self.required_bytes(request)

    def release(self, sequence_id: str) -> bool:
        """Free a sequence's reservation; False if the stage did not hold it."""
        return self.reserved.pop(sequence_id, None) is not None

    def clear(self) -> None:
        """Every reservation and kept entry gone (the coordinator that made them is)."""
        self.reserved.clear()
        self.pinned.clear()

    @property
    def usage_fraction(self) -> float:
        return self.used_bytes / self.budget_bytes if self.budget_bytes else 1.0


def coordinated_admission(
    managers: Sequence[StageKvManager], request: AdmissionRequest
) -> AdmissionDiagnostic | None:
    """Dry-run on every stage; commit on all only if all accept. None means admitted."""
    for manager in managers:
        problem = manager.dry_run(request)
        if problem is not None:
            return problem
    for manager in managers:
        manager.commit(request)
    return None


@dataclass
class SlotKvManager(StageKvManager):
    """A tensor-parallel stage's KV accounting, kept by its rank 0: its own slot (this object)
    and one ``StageKvManager`` per other rank, each with the budget that rank reported when the
    group formed. The other ranks mirror rank 0's every cache operation in order
    (``engine/tp_mirror.py``), so their holdings are exactly these counts."""

    others: list[StageKvManager] = field(default_factory=list)

    @property
    def slots(self) -> list[StageKvManager]:
        return [self, *self.others]

    def dry_run(self, request: AdmissionRequest) -> AdmissionDiagnostic | None:
        own = super().dry_run(request)
        if own is not None:
            return own
        for slot in self.others:
            problem = slot.dry_run(request)
            if problem is not None:
                return problem
        return None

    def commit(self, request: AdmissionRequest) -> None:
        problem = self.dry_run(request)
        if problem is not None:
            raise ValueError(problem.message())
        for slot in self.slots:
            slot.reserved[request.sequence_id] = slot.required_bytes(request)

    def release(self, sequence_id: str) -> bool:
        for slot in self.others:
            slot.release(sequence_id)
        return super().release(sequence_id)

    def pin(self, entry: str, tokens: int) -> None:
        for slot in self.others:
            slot.pin(entry, tokens)
        super().pin(entry, tokens)

    def unpin(self, entry: str) -> None:
        for slot in self.others:
            slot.unpin(entry)
        super().unpin(entry)

    def clear(self) -> None:
        for slot in self.others:
            slot.clear()
        super().clear()


def configured_budget(reported: object) -> int | None:
    """A stage report's ``kv_budget_bytes`` as configured: None when it is unlimited."""
    if reported is None:
        return None
    value = int(str(reported))
    return value if value < UNLIMITED_BYTES else None
