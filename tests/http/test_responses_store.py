"""The Responses API's store (``http/responses_store.py``): an LRU bounded by entries and by
bytes. Shown: past either bound the least recently used entries go first (a fetch counts as a
use), an entry larger than the whole byte bound is not kept, deleting frees its bytes, and a
store of 0 entries keeps nothing."""

from __future__ import annotations

from typing import Any

from mlxppd.http.responses_store import ResponseStore


def _response(key: str, text: str = "") -> dict[str, Any]:
    return {"id": key, "output": [{"type": "message", "text": text}]}


def test_past_the_entry_bound_the_least_recently_used_goes_first() -> None:
    store = ResponseStore(max_entries=2, max_bytes=1 << 20)
    assert store.put(_response("a"), [], [])
    assert store.put(_response("b"), [], [])
    assert store.get("a") is not None  # "a" is now the most recently used
    assert store.put(_response("c"), [], [])
    assert store.get("b") is None
    assert [store.get(k) is not None for k in ("a", "c")] == [True, True]
    assert len(store) == 2


def test_the_byte_bound_drops_old_entries_and_refuses_one_too_large() -> None:
    store = ResponseStore(max_entries=100, max_bytes=600)
    for key in "abc":
        assert store.put(_response(key, "x" * 150), [], [])
    assert store.bytes <= 600
    assert store.get("a") is None and store.get("c") is not None
    assert not store.put(_response("huge", "x" * 1000), [], [])
    assert store.get("huge") is None and store.get("c") is not None
    held = store.bytes
    assert store.delete("c") and not store.delete("c")
    assert store.bytes < held


def test_a_store_of_no_entries_keeps_nothing() -> None:
    store = ResponseStore(max_entries=0)
    assert not store.put(_response("a"), [], [])
    assert store.get("a") is None and len(store) == 0
