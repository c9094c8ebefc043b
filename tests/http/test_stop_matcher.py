"""Stop strings are found in a growing text by reading each new character once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlxppd.http.completion import StopMatcher


def fed(stops: list[str], pieces: list[str]) -> tuple[int | None, int]:
    """Feed the text piece by piece, as tokens arrive: (hit, holdback after the last piece)."""
    matcher = StopMatcher(stops)
    text = ""
    for piece in pieces:
        text += piece
        if matcher.feed(text) is not None:
            break
    return matcher.hit, matcher.holdback


def test_a_stop_string_is_found_where_it_starts_even_across_tokens() -> None:
    assert fed(["is Paris", "\n\n"], ["France ", "is Pa", "ris."])[0] == 7
    assert fed(["is Paris", "\n\n"], ["a\n", "\nb"])[0] == 1
    assert fed([], ["anything"]) == (None, 0)


def test_the_tail_that_may_still_become_a_stop_string_is_held_back() -> None:
    assert fed(["is Paris", "\n\n"], ["The capital is"]) == (None, 2)
    assert fed(["is Paris", "\n\n"], ["The capital is P"]) == (None, 4)
    assert fed(["is Paris", "\n\n"], ["end\n"]) == (None, 1)
    assert fed(["is Paris"], ["nothing"]) == (None, 0)
    # A mismatch keeps the part of the text that can still start the stop string.
    assert fed(["aab"], ["a", "a", "a"]) == (None, 2)
    assert fed(["aab"], ["a", "a", "a", "b"])[0] == 1


def test_the_earliest_of_several_stop_strings_wins() -> None:
    assert fed(["cd", "bcde"], ["abcde"])[0] == 1


alphabet = st.text(alphabet="ab\n", max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=5), max_size=4),
    pieces=st.lists(st.text(alphabet="ab\n", max_size=4), max_size=12),
)
def test_incremental_matching_equals_searching_the_whole_text(
    stops: list[str], pieces: list[str]
) -> None:
    """The reference: after each piece, search the whole text so far with str.find."""
    text = ""
    expected = None
    for piece in pieces:
        text += piece
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            expected = min(hits)
            break
    hit, holdback = fed(stops, pieces)
    assert hit == expected
    if expected is None:
        longest = max(
            (n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0
        )
        assert holdback == longest
