"""Per-stage layer ranges: parsing ``--pp-layers``, even splits, adjacency checks, formatting.

Users write inclusive ranges ("0-14,15-29", one per stage, in stage order); the code works with
half-open ``LayerRange(start, end)`` values so that counts and slicing need no ``+ 1``.

Some layers must share a stage: a Gemma 4 KV-shared layer reads the cache that an earlier layer
wrote, so a stage boundary between the two would strand that cache on the wrong host. Such a pair
is an ``AdjacencyGroup``; no stage may start strictly inside it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from mlxppd.core.errors import ConfigurationError

__all__ = [
    "AdjacencyGroup",
    "LayerRange",
    "check_adjacency",
    "check_layer_ranges",
    "even_split",
    "format_pp_layers",
    "parse_layer_range",
    "parse_pp_layers",
]

_PP_LAYERS = "--pp-layers"
_PP_SIZE = "--pp-size"
_EXAMPLE = "'0-14,15-29'"
# Digits only: a leading '-' (negative layer) or any other separator is a syntax error.
_RANGE_RE = re.compile(r"\s*(\d+)\s*-\s*(\d+)\s*")


@dataclass(frozen=True, order=True)
class LayerRange:
    """Transformer layers ``start`` (inclusive) to ``end`` (exclusive) held by one stage."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise ValueError(
                f"LayerRange needs 0 <= start < end, got start={self.start}, end={self.end}"
            )

    @property
    def count(self) -> int:
        """Number of layers in the range."""
        return self.end - self.start

    @property
    def last(self) -> int:
        """Index of the last layer in the range (inclusive)."""
        return self.end - 1

    @property
    def pair(self) -> tuple[int, int]:
        """``(start, end)``: how a range is written on the wire and in reports."""
        return (self.start, self.end)

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.end

    def __str__(self) -> str:
        return f"{self.start}-{self.last}"


@dataclass(frozen=True, order=True)
class AdjacencyGroup:
    """Layers ``first`` (the source) to ``last`` (the consumer), inclusive, must share one stage.

    A stage may start at ``first`` or after ``last``, never at ``first + 1 .. last``.
    """

    first: int
    last: int
    #: why the layers belong together, for messages ("layer 34 reads the KV cache of layer 14");
    #: not part of the group's identity
    reason: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.first < 0 or self.last <= self.first:
            raise ValueError(
                f"AdjacencyGroup needs 0 <= first < last, got first={self.first}, last={self.last}"
            )

    def is_cut_by(self, stage_start: int) -> bool:
        """Whether a stage starting at layer ``stage_start`` would separate source and consumer."""
        return self.first < stage_start <= self.last

    def __str__(self) -> str:
        return f"{self.first}..{self.last}"


def _describe_layers(start: int, end: int) -> str:
    """Name the half-open span [start, end) the way a user writes it."""
    return f"layer {start}" if end - start == 1 else f"layers {start}-{end - 1}"


def parse_layer_range(text: str) -> LayerRange:
    """Parse one inclusive range "a-b"; raises ValueError with a user-facing sentence."""
    match = _RANGE_RE.fullmatch(text)
    if match is None:
        raise ValueError(
            f"'{text.strip()}' is not a layer range; write inclusive ranges of non-negative "
            f"layer numbers like {_EXAMPLE}"
        )
    first, last = int(match.group(1)), int(match.group(2))
    if first > last:
        raise ValueError(
            f"in range '{text.strip()}' the start {first} is after the end {last}; "
            f"write it as '{last}-{first}'"
        )
    return LayerRange(first, last + 1)


def _split_ranges(text: str) -> tuple[LayerRange, ...]:
    if not text.strip():
        raise ValueError(
            f"no layer ranges given; write one inclusive range per stage, like {_EXAMPLE}"
        )
    return tuple(parse_layer_range(part) for part in text.split(","))


def check_layer_ranges(ranges: Sequence[LayerRange], num_layers: int | None = None) -> None:
    """Check that ``ranges`` (in stage order) tile layers 0..num_layers-1 exactly once.

    With ``num_layers`` None only the shape is checked (start at 0, in order, no overlap, no
    gap), as for a cluster TOML read before the model is known. Raises ValueError.
    """
    if len(ranges) < 1:
        raise ValueError(
            f"no layer ranges given; write one inclusive range per stage, like {_EXAMPLE}"
        )
    if num_layers is not None:
        for r in ranges:
            if r.end > num_layers:
                raise ValueError(
                    f"range '{r}' passes the last layer: the model has {num_layers} layers "
                    f"(0-{num_layers - 1})"
                )
    # Overlaps are checked on the sorted ranges so that any two overlapping ranges are named,
    # even when they are not neighbours in the given order.
    ordered = sorted(ranges)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if b.start < a.end:
            shared = _describe_layers(b.start, min(a.end, b.end))
            raise ValueError(
                f"ranges '{a}' and '{b}' overlap on {shared}; give each layer to exactly one stage"
            )
    if list(ranges) != ordered:
        listed = ",".join(str(r) for r in ranges)
        raise ValueError(
            f"ranges '{listed}' are not in layer order; list one range per stage, from stage 0 "
            f"upward, like {_EXAMPLE}"
        )
    if ranges[0].start != 0:
        raise ValueError(
            f"the first range '{ranges[0]}' does not start at layer 0; "
            f"{_describe_layers(0, ranges[0].start)} would belong to no stage"
        )
    for a, b in zip(ranges, ranges[1:], strict=False):
        if b.start > a.end:
            verb = "belongs" if b.start - a.end == 1 else "belong"
            raise ValueError(
                f"{_describe_layers(a.end, b.start)} between '{a}' and '{b}' {verb} to no stage; "
                "make the ranges contiguous"
            )
    if num_layers is not None and ranges[-1].end != num_layers:
        raise ValueError(
            f"the last range '{ranges[-1]}' does not end at the model's last layer "
            f"{num_layers - 1} (the model has {num_layers} layers); "
            f"{_describe_layers(ranges[-1].end, num_layers)} would belong to no stage"
        )


def check_adjacency(ranges: Sequence[LayerRange], groups: Iterable[AdjacencyGroup]) -> None:
    """Check that no stage boundary of ``ranges`` falls inside an adjacency group.

    Raises ValueError naming the (source, consumer) pair the first offending boundary separates
    and the nearest boundaries that keep every group together.
    """
    groups = tuple(groups)

    def blocked(start: int) -> bool:
        return any(g.is_cut_by(start) for g in groups)

    for a, b in zip(ranges, ranges[1:], strict=False):
        cut = sorted(g for g in groups if g.is_cut_by(b.start))
        if not cut:
            continue
        group = cut[0]
        why = f" ({group.reason})" if group.reason else ""
        more = f" and {len(cut) - 1} more pair(s)" if len(cut) > 1 else ""
        below = next((s for s in range(b.start - 1, a.start, -1) if not blocked(s)), None)
        above = next((s for s in range(b.start + 1, b.end) if not blocked(s)), None)
        options = [f"layer {s}" for s in (below, above) if s is not None]
        fix = (
            f"start stage '{b}' at {' or '.join(options)} instead"
            if options
            else "merge the two stages or move a neighbouring boundary"
        )
        raise ValueError(
            f"the boundary between '{a}' and '{b}' separates layer {group.first} from layer "
            f"{group.last}{why}{more}; a source and its consumer must be on one stage: {fix}"
        )


def parse_pp_layers(
    text: str, num_layers: int, groups: Iterable[AdjacencyGroup] = ()
) -> tuple[LayerRange, ...]:
    """Parse ``--pp-layers`` ("0-14,15-29": inclusive, one per stage) for a model of ``num_layers``.

    ``groups`` are the model's adjacency groups; a boundary inside one is refused.
    Raises ConfigurationError(source="--pp-layers") with one sentence naming the problem.
    """
    try:
        ranges = _split_ranges(text)
        check_layer_ranges(ranges, num_layers)
        check_adjacency(ranges, tuple(groups))
    except ValueError as exc:
        raise ConfigurationError(str(exc), source=_PP_LAYERS) from None
    return ranges


def even_split(num_layers: int, num_stages: int) -> tuple[LayerRange, ...]:
    """Split ``num_layers`` into ``num_stages`` contiguous ranges whose sizes differ by at most 1.

    Earlier stages get the extra layer (stage 0 also embeds, but the last stage runs the lm_head,
    so neither end is clearly lighter).
    """
    if num_layers < 1:
        raise ConfigurationError(f"the model has {num_layers} layers; nothing to split")
    if num_stages < 1:
        raise ConfigurationError(
            f"{num_stages} stages requested; use --pp-size 1 or more", source=_PP_SIZE
        )
    if num_stages > num_layers:
        raise ConfigurationError(
            f"{num_stages} stages requested but the model has {num_layers} layers; "
            f"use a --pp-size of at most {num_layers}",
            source=_PP_SIZE,
        )
    base, extra = divmod(num_layers, num_stages)
    ranges = []
    start = 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(LayerRange(start, start + size))
        start += size
    return tuple(ranges)


def format_pp_layers(ranges: Iterable[LayerRange]) -> str:
    """Inverse of ``parse_pp_layers``: "0-14,15-29"."""
    return ",".join(str(r) for r in ranges)
