"""Which prompt prefixes the stages keep, and which one a new request reuses (pure).

The coordinator is the one authority: it names every entry, and every stage keeps and forgets
exactly what it is told, so all stages agree on what is cached. An entry is the token
sequence whose KV caches the stages hold (a finished request's prompt and its generated
tokens but the last, which never went through the model). A new prompt reuses the entry with
which it shares the longest prefix, keeping at least one token of its own to compute; entries
are bounded in number and evicted least recently used, and the coordinator also evicts when a
stage's KV budget is full.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

#: a shared prefix shorter than this is not worth copying caches for (tokens)
MIN_REUSE_TOKENS = 8


@dataclass(frozen=True)
class Reuse:
    entry: str
    tokens: int
    """prompt tokens taken from the entry (its first ``tokens``)"""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptIndex:
    """The coordinator's record of the entries every stage holds, least recently used first."""

    def __init__(self, capacity: int, min_reuse: int = MIN_REUSE_TOKENS) -> None:
        self.capacity = capacity
        self.min_reuse = min_reuse
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        #: what each entry was computed with (an adapter's name; "" = the base model)
        self._tags: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: Sequence[int], tag: str = "") -> Reuse | None:
        """The entry of ``tag`` sharing the longest prefix with ``prompt`` (marked used)."""
        best: Reuse | None = None
        # Most recently used first: of equal prefixes, the one still warmest wins.
        for entry, tokens in reversed(self._entries.items()):
            if self._tags.get(entry, "") != tag:
                continue
            # The last prompt token always runs: its logits give the first sampled token.
            shared = min(common_prefix(tokens, prompt), len(prompt) - 1)
            if shared >= self.min_reuse and (best is None or shared > best.tokens):
                best = Reuse(entry, shared)
        if best is not None:
            self._entries.move_to_end(best.entry)
        return best

    def add(self, entry: str, tokens: Sequence[int], tag: str = "") -> list[str]:
        """Record a new entry; returns the entries to forget to stay within capacity."""
        self._entries[entry] = tuple(tokens)
        self._tags[entry] = tag
        self._entries.move_to_end(entry)
        evicted = []
        while len(self._entries) > self.capacity:
            gone = self._entries.popitem(last=False)[0]
            self._tags.pop(gone, None)
            evicted.append(gone)
        return evicted

    def forget_tag(self, tag: str) -> list[str]:
        """Drop every entry of ``tag`` (its adapter is unloaded); returns them."""
        gone = [e for e, t in self._tags.items() if t == tag]
        for entry in gone:
            self.forget(entry)
        return gone

    def oldest(self) -> str | None:
        return next(iter(self._entries), None)

    def forget(self, entry: str) -> None:
        self._entries.pop(entry, None)
        self._tags.pop(entry, None)

    def clear(self) -> list[str]:
        gone = list(self._entries)
        self._entries.clear()
        self._tags.clear()
        return gone
