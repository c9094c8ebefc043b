"""One stage's per-sequence state and compute, run on the process's mlx thread.

A sequence's KV caches live here from its first forward until it is released. The last stage
also holds each sequence's sampler, samples from the last position and returns only the token
(and its logprob when asked): logits and hidden states never go back to the coordinator.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from mlxppd.core.protocol.pipeline import regroup
from mlxppd.engine.sampling import GREEDY, Sampled, SequenceSampler, sample_rows
from mlxppd.engine.stage import LoadedStage


@dataclass
class _Group:
    """A decode micro-batch: its members in batch order and one batched cache per layer."""

    seqs: list[str] = field(default_factory=list)
    caches: list[Any] | None = None
    released: set[str] = field(default_factory=set)
    #: the members' caches have no batch form (mlx-lm cannot merge them): run row by row
    unbatched: bool = False


@dataclass(frozen=True, slots=True)
class RowFailed:
    """A micro-batch member whose sampling failed on this stage."""

    message: str


def _mergeable(caches: list[Any]) -> bool:
    return all(callable(getattr(type(c), "merge", None)) for c in caches)


class EntryMissing(ValueError):
    """A prompt-cache entry a step starts from is not here (not kept, or gone with a
    repartition): the coordinator prefills that sequence again from its first token."""


class StageRunner:
    def __init__(self, stage: LoadedStage):
        self.stage = stage
        self._caches: dict[str, list[Any]] = {}
        self._samplers: dict[str, SequenceSampler] = {}
        self._groups: dict[str, _Group] = {}
        self._group_of: dict[str, str] = {}
        #: prompt-cache entries kept for the coordinator: entry id -> (caches, tokens held)
        self._entries: dict[str, tuple[list[Any], int]] = {}
        #: the per-request adapter each sequence runs (absent: the base model)
        self._adapter_of: dict[str, str] = {}

    def _select(self, seqs: list[str]) -> None:
        """Tell the adapted modules which adapter each row of the next pass runs."""
        adapters = self.stage.adapters
        if adapters is not None and adapters.named:
            adapters.select([self._adapter_of.get(s) for s in seqs])

    def set_adapter(self, seq: str, name: str | None) -> None:
        """``seq`` runs per-request adapter ``name`` (None: the base model) until released."""
        if name is None:
            self._adapter_of.pop(seq, None)
            return
        adapters = self.stage.adapters
        if adapters is None or name not in adapters.named:
            raise ValueError(f"adapter {name!r} is not loaded on this stage")
        self._adapter_of[seq] = name

    def adapter_users(self, name: str) -> int:
        return sum(1 for n in self._adapter_of.values() if n == name)

    # -- micro-batches -------------------------------------------------------------------------

    def _regroup(self, group_id: str, seqs: list[str]) -> list[Any] | None:
        """Bring the group's batched caches to ``seqs``: filter leavers, merge newcomers.
        None for a group whose caches cannot batch: its members keep their own."""
        group = self._groups.setdefault(group_id, _Group())
        if regroup(group.seqs, seqs) != seqs:
            raise ValueError(f"micro-batch {group_id}: members out of order: {seqs}")
        if group.caches is None and not group.unbatched:
            held = [self._caches.get(s) for s in seqs if s not in set(group.seqs)]
            group.unbatched = any(c is not None and not _mergeable(c) for c in held)
        if group.unbatched:
            for gone in set(group.seqs) - set(seqs):
                self._group_of.pop(gone, None)
                self._caches.pop(gone, None)
            for seq in seqs:
                if seq not in self._caches:
                    raise ValueError(f"sequence {seq} holds no caches here to join a micro-batch")
                self._group_of[seq] = group_id
            group.seqs = list(seqs)
            group.released -= set(seqs)
            return None
        keep = [i for i, s in enumerate(group.seqs) if s in set(seqs)]
        if group.caches is not None and len(keep) < len(group.seqs):
            if keep:
                for cache in group.caches:
                    cache.filter(mx.array(keep))
            else:
                group.caches = None
        for gone in set(group.seqs) - set(seqs):
            self._group_of.pop(gone, None)
        newcomers = [s for s in seqs if s not in set(group.seqs)]
        if newcomers:
            singles = []
            for seq in newcomers:
                single = self._caches.pop(seq, None)
                if single is None:
                    raise ValueError(f"sequence {seq} holds no caches here to join a micro-batch")
                singles.append(single)
                self._group_of[seq] = group_id
            # mlx-lm's batch caches: left-padded to the longest member, as BatchGenerator does.
            merged = [type(parts[0]).merge(list(parts)) for parts in zip(*singles, strict=True)]
            if group.caches is None:
                group.caches = merged
            else:
                for cache, extra in zip(group.caches, merged, strict=True):
                    cache.extend(extra)
        group.seqs = list(seqs)
        group.released -= set(seqs)
        assert group.caches is not None
        return group.caches

    def _group_forward(
        self, group_id: str, seqs: list[str], x: mx.array, head: bool = True
    ) -> mx.array:
        caches = self._regroup(group_id, seqs)
        if caches is not None:
            self._select(seqs)
            return self.stage(x, caches, head)
        rows = []
        for i, s in enumerate(seqs):
            self._select([s])
            rows.append(self.stage(x[i : i + 1], self._caches[s], head))
        return mx.concatenate(rows, axis=0)

    def forward_group(
        self, group_id: str, seqs: list[str], x: mx.array, head: bool = True
    ) -> mx.array:
        """One batched forward pass of a decode micro-batch; the output is evaluated.
        ``head``: False skips the last stage's output head (a tensor-parallel follower)."""
        out = self._group_forward(group_id, seqs, x, head)
        mx.eval(out)
        return out

    def forward_group_and_sample(
        self, group_id: str, seqs: list[str], x: mx.array, logprobs: bool
    ) -> list[Sampled | RowFailed]:
        """The members' next tokens; a member whose own sampling failed gets a ``RowFailed``
        in its row, and the others their tokens (its failure is not the group's)."""
        logits = self._group_forward(group_id, seqs, x)[:, -1, :]
        samplers = [self._samplers.get(s, GREEDY) for s in seqs]
        # Rows with only a draw (and top logprobs) share one normalization, one top-k and one
        # evaluation: a row costs a row, not an evaluation of its own. Rows with processors or
        # a grammar carry state from token to token and are sampled one by one.
        shared = [i for i, s in enumerate(samplers) if not (s.processors or s.constraint)]
        out: list[Sampled | RowFailed] = [RowFailed("")] * len(seqs)
        if shared:
            rows = mx.array(shared) if len(shared) < len(seqs) else None
            batch = logits[rows] if rows is not None else logits
            picked = [samplers[i] for i in shared]
            for i, row in zip(shared, sample_rows(batch, picked, logprobs), strict=True):
                out[i] = row
        for i, sampler in enumerate(samplers):
            if sampler.processors or sampler.constraint:
                try:
                    out[i] = sampler.sample(sampler.scores(logits[i : i + 1]), logprobs)
                except Exception as exc:  # one member's sampler (its grammar, its processors)
                    out[i] = RowFailed(str(exc))
        return out

    @property
    def active(self) -> int:
        return len(self._caches)

    def holds(self, seq: str) -> bool:
        """``seq`` has caches here (alone, or as a member of a micro-batch not released)."""
        if seq in self._caches:
            return True
        group_id = self._group_of.get(seq)
        return group_id is not None and seq not in self._groups[group_id].released

    def set_sampler(self, seq: str, sampler: SequenceSampler) -> None:
        """The sampler of ``seq`` until it is released (greedy when none is set)."""
        self._samplers[seq] = sampler

    def fork(self, source: str, seq: str) -> None:
        """``seq`` starts from a copy of ``source``'s caches (the choices of one prompt share
        its prefill); the copy is independent from here on."""
        caches = self._caches.get(source)
        if caches is None:
            raise ValueError(f"sequence {seq} forks from {source}, which holds no caches here")
        self._caches[seq] = copy.deepcopy(caches)
        if source in self._adapter_of:
            self._adapter_of[seq] = self._adapter_of[source]

    def forward(self, seq: str, x: mx.array) -> mx.array:
        """Run this stage's layers for one sequence; the output is evaluated. On the last
        stage that is a prefill chunk nobody samples from: its output head is skipped."""
        cache = self._caches.get(seq)
        if cache is None:
            cache = self._caches[seq] = self.stage.make_cache()
        self._select([seq])
        out = self.stage(x, cache, head=False)
        mx.eval(out)
        return out

    def forward_and_sample(self, seq: str, x: mx.array, logprobs: bool) -> Sampled:
        """Last stage: forward, then sample the next token from the last position."""
        cache = self._caches.get(seq)
        if cache is None:
            cache = self._caches[seq] = self.stage.make_cache()
        self._select([seq])
        logits = self.stage(x, cache)[:, -1, :]
        sampler = self._samplers.get(seq, GREEDY)
        return sampler.sample(sampler.scores(logits), logprobs)

    def keep(self, seq: str, entry: str, tokens: int) -> bool:
        """Keep ``seq``'s caches as prompt-cache ``entry`` (it is released otherwise); False
        when they cannot be kept (not held here, or in a batch its caches cannot leave)."""
        caches = self._caches.get(seq)
        group_id = self._group_of.get(seq)
        if caches is None and group_id is not None:
            group = self._groups[group_id]
            row = group.seqs.index(seq)
            try:
                caches = [c.extract(row) for c in group.caches or ()]
            except (AttributeError, NotImplementedError, ValueError):
                caches = None
        self.release(seq)
        if not caches:
            return False
        self._entries[entry] = (caches, tokens)
        return True

    def start_from(self, entry: str, seq: str, tokens: int) -> None:
        """``seq`` starts from a copy of ``entry``'s caches cut to their first ``tokens``."""
        kept = self._entries.get(entry)
        if kept is None:
            raise EntryMissing(f"prompt-cache entry {entry} is not held here")
        caches, held = copy.deepcopy(kept[0]), kept[1]
        if held > tokens and not (
            can_trim_prompt_cache(caches)
            and trim_prompt_cache(caches, held - tokens) == held - tokens
        ):
            raise ValueError(f"prompt-cache entry {entry} cannot be cut to {tokens} tokens")
        self._caches[seq] = caches

    def forget(self, entry: str) -> None:
        self._entries.pop(entry, None)

    def release_all(self) -> None:
        self._adapter_of.clear()
        self._entries.clear()
        self._samplers.clear()
        self._caches.clear()
        self._groups.clear()
        self._group_of.clear()

    def release(self, seq: str) -> bool:
        self._samplers.pop(seq, None)
        self._adapter_of.pop(seq, None)
        group_id = self._group_of.get(seq)
        if group_id is not None:
            # The batch drops the row at its next step; a group whose members are all gone
            # frees its caches now.
            group = self._groups[group_id]
            group.released.add(seq)
            if group.unbatched:
                self._caches.pop(seq, None)
            if group.released >= set(group.seqs):
                for member in group.seqs:
                    self._group_of.pop(member, None)
                del self._groups[group_id]
            return True
        return self._caches.pop(seq, None) is not None
