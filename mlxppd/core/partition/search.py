"""The exact search behind ``balance_layers``.

1. ``SplitSearch.search`` decides exactly whether a split with every stage load inside given
   per-stage bounds exists. It walks the stages in order, keeping the set of boundaries the
   stages so far can end on; a boundary ``e`` is reachable by stage ``k`` when some reachable
   ``s < e`` gives ``[s, e)`` a load inside stage ``k``'s bounds. Prefix sums and bisection make
   each test a lookup, and what the remaining stages can still hold prunes the candidate
   boundaries to a narrow window, so a 1,000-layer, 8-stage search takes about a millisecond.
   A set, not a single greedy frontier, is what keeps it exact with per-stage budgets: ending
   a stage as late as possible can leave the next, tighter stage facing a block it cannot hold.
2. ``optimal_bounds`` binary-searches the largest load T (each success lowers T to the largest
   load it found, so T always is the load of a real plan) for the smallest feasible T, then
   raises the lightest stage as far as T allows, so the plan is as even as the optimum permits.
3. ``least_overflow_bounds`` is the diagnosis for budgets that cannot be met: the plan needing
   the smallest equal amount of extra memory on every budgeted stage.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import accumulate

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import AdjacencyGroup
from mlxppd.core.profile.model import ModelProfile

__all__ = ["SplitSearch", "check_stage_count", "least_overflow_bounds", "optimal_bounds"]

_PP_SIZE = "--pp-size"


class SplitSearch:
    """Layer weights, fixed per-stage extras and the allowed boundaries of one balancing task."""

    def __init__(self, profile: ModelProfile, num_stages: int, groups: Sequence[AdjacencyGroup]):
        n, k = profile.num_layers, num_stages
        self.n, self.k = n, k
        self.prefix = [0, *accumulate(profile.layer_bytes)]
        if k == 1:
            self.extras = [
                profile.embedding_bytes + profile.lm_head_bytes - profile.shared_end_bytes
            ]
        else:
            self.extras = [profile.embedding_bytes, *([0] * (k - 2)), profile.lm_head_bytes]
        # A stage may start at s unless s lies inside a group (first < s <= last).
        blocked = [0] * (n + 2)
        for g in groups:
            blocked[g.first + 1] += 1
            blocked[g.last + 1] -= 1
        depth = list(accumulate(blocked))
        self.cuts = [s for s in range(1, n) if depth[s] == 0]

    def loads(self, bounds: Sequence[int]) -> list[int]:
        p = self.prefix
        return [p[bounds[i + 1]] - p[bounds[i]] + self.extras[i] for i in range(self.k)]

    def search(self, caps: Sequence[int | None], floor: int = 0) -> list[int] | None:
        """Boundaries [0, b1, ..., n] with every stage load in [floor, caps[k]], or None."""
        p, n, k = self.prefix, self.n, self.k
        total = p[n]
        bounds: list[int] = []
        for cap, extra in zip(caps, self.extras, strict=True):
            bounds.append(total + 1 if cap is None else cap - extra)
        if min(bounds) < 0:
            return None
        # room[j]: layer bytes stages j.. can still take (caps of None are unbounded)
        room = [0] * (k + 1)
        for j in range(k - 1, -1, -1):
            room[j] = room[j + 1] + bounds[j]
        reach: list[list[int]] = [[0]]
        for stage in range(k):
            ub, lb = bounds[stage], floor - self.extras[stage]
            prev = reach[-1]
            if stage == k - 1:
                targets: Sequence[int] = [n]
            else:
                lo_e = max(prev[0] + 1, bisect_left(p, total - room[stage + 1]))
                hi_e = min(bisect_right(p, p[prev[-1]] + ub) - 1, n - (k - 1 - stage))
                targets = self.cuts[bisect_left(self.cuts, lo_e) : bisect_right(self.cuts, hi_e)]
            found = []
            for e in targets:
                lo_s = bisect_left(p, p[e] - ub)
                hi_s = e - 1 if lb <= 0 else min(e - 1, bisect_right(p, p[e] - lb) - 1)
                j = bisect_left(prev, lo_s)
                if j < len(prev) and prev[j] <= hi_s:
                    found.append(e)
            if not found:
                return None
            reach.append(found)
        # Walk back from the last layer; each stage starts as late as its bounds allow, which
        # gives earlier stages the extra layer when loads tie.
        out = [n]
        e = n
        for stage in range(k - 1, -1, -1):
            ub, lb = bounds[stage], floor - self.extras[stage]
            hi_s = e - 1 if lb <= 0 else min(e - 1, bisect_right(p, p[e] - lb) - 1)
            prev = reach[stage]
            e = prev[bisect_right(prev, hi_s) - 1]
            out.append(e)
        return out[::-1]


def check_stage_count(profile: ModelProfile, num_stages: int, problem: SplitSearch) -> None:
    """Refuse stage counts no split can have (more stages than layers or than allowed starts)."""
    n = profile.num_layers
    if num_stages < 1:
        raise ConfigurationError(
            f"{num_stages} stages requested; use --pp-size 1 or more", source=_PP_SIZE
        )
    if num_stages > n:
        raise ConfigurationError(
            f"{num_stages} stages requested but the model has {n} layers; "
            f"use a --pp-size of at most {n}",
            source=_PP_SIZE,
        )
    if num_stages - 1 > len(problem.cuts):
        raise ConfigurationError(
            f"{num_stages} stages requested but the model's adjacency groups (layers that must "
            f"share a stage) leave only {len(problem.cuts)} places to start a stage; use a "
            f"--pp-size of at most {len(problem.cuts) + 1}",
            source=_PP_SIZE,
        )


def optimal_bounds(problem: SplitSearch, budgets: Sequence[int | None]) -> list[int] | None:
    """The optimal split's boundaries [0, b1, ..., n] within ``budgets`` (None: unlimited),
    or None when the budgets admit no split at all."""
    num_stages = problem.k
    best = problem.search(budgets)
    if best is None:
        return None

    def capped(t: int) -> list[int | None]:
        return [t if b is None else min(t, b) for b in budgets]

    # Smallest T such that every stage load <= T (and its budget): each success drops T to the
    # largest load actually found, so the search ends on a load of a real plan.
    loads = problem.loads(best)
    lo = -(-(problem.prefix[-1] + sum(problem.extras)) // num_stages)
    hi = max(loads)
    while lo < hi:
        mid = (lo + hi) // 2
        found = problem.search(capped(mid))
        if found is None:
            lo = mid + 1
        else:
            best, hi = found, max(problem.loads(found))
    # Among the plans whose largest load is T, raise the smallest load as far as it goes.
    caps = capped(hi)
    floor_lo, floor_hi = min(problem.loads(best)), hi
    while floor_lo < floor_hi:
        mid = (floor_lo + floor_hi + 1) // 2
        found = problem.search(caps, floor=mid)
        if found is None:
            floor_hi = mid - 1
        else:
            best, floor_lo = found, min(problem.loads(found))
    return best


def least_overflow_bounds(problem: SplitSearch, budgets: Sequence[int | None]) -> list[int]:
    """The split needing the smallest equal extra D on every budgeted stage to fit."""

    def overflow(bounds: list[int]) -> int:
        loads = problem.loads(bounds)
        return max(load - b for load, b in zip(loads, budgets, strict=True) if b is not None)

    def search(extra: int) -> list[int] | None:
        return problem.search([None if b is None else b + extra for b in budgets])

    best = search(problem.prefix[-1] + sum(problem.extras))
    assert best is not None, "with room for the whole model any valid stage count has a split"
    lo, hi = 0, max(overflow(best), 0)
    while lo < hi:
        mid = (lo + hi) // 2
        found = search(mid)
        if found is None:
            lo = mid + 1
        else:
            best, hi = found, overflow(found)
    return best
