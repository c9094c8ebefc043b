"""Stored responses: what ``GET /v1/responses/{id}`` returns and ``previous_response_id``
continues, kept in memory and bounded.

An entry is a response, the input items it was made from, and the conversation so far in the
chat template's messages (the earlier turns, this input, this output), so a next turn renders
the same prefix and the stages' prompt cache serves it. Least recently used entries go first
once either bound is passed: the number of entries or their bytes (as JSON). One entry larger
than the byte bound is not kept. Nothing survives a restart: a client that must keep a
conversation sends it whole.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

DEFAULT_STORE_ENTRIES = 1024
DEFAULT_STORE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    #: the input items, as ``input_items`` lists them (each with an id)
    items: tuple[dict[str, Any], ...]
    #: the conversation for the chat template, output included; no instructions (OpenAI does
    #: not carry them over to the next turn)
    messages: tuple[dict[str, Any], ...]
    size: int


class ResponseStore:
    """An LRU of responses, bounded by ``max_entries`` and ``max_bytes``."""

    def __init__(
        self, max_entries: int = DEFAULT_STORE_ENTRIES, max_bytes: int = DEFAULT_STORE_BYTES
    ) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("the response store's bounds must not be negative")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        response: dict[str, Any],
        items: Sequence[dict[str, Any]],
        messages: Sequence[dict[str, Any]],
    ) -> bool:
        """Keep ``response`` under its id; False when it is larger than the whole store."""
        parts = (response, list(items), list(messages))
        size = len(json.dumps(parts, separators=(",", ":"), ensure_ascii=False).encode())
        if size > self.max_bytes or self.max_entries == 0:
            return False
        key = response["id"]
        self.delete(key)
        self._entries[key] = StoredResponse(response, tuple(items), tuple(messages), size)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.size
        return True

    def get(self, key: str) -> StoredResponse | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def delete(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True


RESPONSE_STORE = web.AppKey("responses_store", ResponseStore)
