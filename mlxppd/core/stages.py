"""What one pipeline stage owns: a layer range plus the embedding and/or the output head."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlxppd.core.layer_ranges import LayerRange

#: the index of a standby node's spec: in no stage, no layers, neither embedding nor head
STANDBY_INDEX = -1


@dataclass(frozen=True)
class StageSpec:
    """Stage ``index`` of ``num_stages`` runs global layers ``[start, end)``."""

    index: int
    num_stages: int
    start: int
    end: int

    @property
    def has_embedding(self) -> bool:
        """The first stage turns token ids into hidden states."""
        return self.index == 0

    @property
    def has_lm_head(self) -> bool:
        """The last stage applies the final norm and the output projection."""
        return self.index == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def owns_layer(self, layer: int) -> bool:
        return self.start <= layer < self.end

    def matches(self, plan: Sequence[LayerRange]) -> bool:
        """True when ``plan`` (a range per stage) gives this stage exactly its layers."""
        if self.is_standby or len(plan) != self.num_stages:
            return False
        return plan[self.index].pair == (self.start, self.end)

    @property
    def is_standby(self) -> bool:
        """A standby holds no layers until the coordinator gives it a lost stage's."""
        return self.index == STANDBY_INDEX

    @classmethod
    def standby(cls, num_stages: int) -> StageSpec:
        return cls(STANDBY_INDEX, num_stages, 0, 0)

    @classmethod
    def holding(cls, index: int, num_stages: int, layers: LayerRange) -> StageSpec:
        """Stage ``index`` of ``num_stages``, holding ``layers``."""
        return cls(index, num_stages, layers.start, layers.end)


def stage_specs(ranges: tuple[LayerRange, ...]) -> tuple[StageSpec, ...]:
    """One StageSpec per contiguous layer range, in stage order."""
    return tuple(StageSpec.holding(i, len(ranges), r) for i, r in enumerate(ranges))
