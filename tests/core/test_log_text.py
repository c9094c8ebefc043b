"""Outside text in a log line cannot forge a line, and a flood of peer-caused events is one
line per interval with the counts of the rest."""

from __future__ import annotations

from mlxppd.core.log_text import escape, quoted
from mlxppd.core.log_throttle import LogThrottle


def test_control_characters_non_ascii_and_lone_surrogates_are_escaped() -> None:
    assert escape("/v1/models\nFORGED") == "/v1/models\\nFORGED"
    assert escape("\x1b[31mred\r") == "\\x1b[31mred\\r"
    assert escape("caf\u00e9 \udcff") == "caf\\xe9 \\udcff"
    assert "\n" not in escape("\n" * 10) and escape("x" * 300).endswith("...")
    assert len(escape("x" * 300, limit=10)) == 13


def test_quoted_reads_like_repr() -> None:
    assert quoted("stage-1") == "'stage-1'"
    assert quoted("a\nb") == "'a\\nb'"
    assert quoted("node 'x'") == "\"node 'x'\""
    assert quoted("both ' and \"") == "'both \\' and \"'"


def test_a_flood_is_one_line_per_interval_carrying_the_counts() -> None:
    now = [0.0]
    throttle = LogThrottle(interval_s=10, clock=lambda: now[0])
    assert throttle.note("bad_magic") == "1 bad_magic"
    for _ in range(5):
        assert throttle.note("timeout") is None
    now[0] = 9.9
    assert throttle.note("bad_magic") is None
    now[0] = 10.0
    assert throttle.note("timeout") == "1 bad_magic, 6 timeout"
    assert throttle.note("timeout") is None
