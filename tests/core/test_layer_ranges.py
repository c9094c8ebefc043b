"""--pp-layers parsing, even splits and formatting (mlxppd.core.layer_ranges)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import (
    LayerRange,
    check_layer_ranges,
    even_split,
    format_pp_layers,
    parse_layer_range,
    parse_pp_layers,
)


def _error(text: str, num_layers: int = 32) -> str:
    with pytest.raises(ConfigurationError) as info:
        parse_pp_layers(text, num_layers)
    assert info.value.source == "--pp-layers"
    message = str(info.value)
    assert message.startswith("--pp-layers: ")
    return message


# -- LayerRange ------------------------------------------------------------------------------


def test_layer_range_is_half_open_and_prints_inclusive() -> None:
    r = LayerRange(15, 30)
    assert (r.start, r.end, r.count, r.last) == (15, 30, 15, 29)
    assert str(r) == "15-29"
    assert 15 in r and 29 in r and 30 not in r and 14 not in r


def test_layer_range_rejects_empty_or_negative() -> None:
    with pytest.raises(ValueError):
        LayerRange(3, 3)
    with pytest.raises(ValueError):
        LayerRange(-1, 4)


def test_layer_range_is_frozen() -> None:
    r = LayerRange(0, 1)
    with pytest.raises(AttributeError):
        r.start = 2  # type: ignore[misc]


# -- parse_pp_layers: accepted input ---------------------------------------------------------


def test_parses_inclusive_ranges_into_half_open() -> None:
    assert parse_pp_layers("0-14,15-29", 30) == (LayerRange(0, 15), LayerRange(15, 30))


def test_spaces_around_numbers_are_allowed() -> None:
    assert parse_pp_layers(" 0 - 14 , 15-29 ", 30) == (LayerRange(0, 15), LayerRange(15, 30))


def test_single_layer_stage() -> None:
    assert parse_pp_layers("0-0,1-2", 3) == (LayerRange(0, 1), LayerRange(1, 3))


def test_a_single_range_covering_everything_is_valid() -> None:
    assert parse_pp_layers("0-31", 32) == (LayerRange(0, 32),)


# -- parse_pp_layers: errors -----------------------------------------------------------------


def test_empty_string() -> None:
    assert "no layer ranges given" in _error("")
    assert "no layer ranges given" in _error("   ")


@pytest.mark.parametrize(
    "text", ["0_15,16-31", "a-b,c-d", "0-,1-31", "-5,6-31", "0-15,", "0-15-31"]
)
def test_bad_syntax_names_the_part_and_the_expected_form(text: str) -> None:
    message = _error(text)
    assert "is not a layer range" in message
    assert "'0-14,15-29'" in message


def test_negative_numbers_are_bad_syntax() -> None:
    message = _error("-1-15,16-31")
    assert "is not a layer range" in message
    assert "non-negative" in message


def test_reversed_range_says_start_is_after_end() -> None:
    message = _error("15-0,16-31")
    assert "the start 15 is after the end 0" in message
    assert "'0-15'" in message


def test_range_past_last_layer_names_layer_count() -> None:
    message = _error("0-15,16-40", 32)
    assert "'16-40' passes the last layer" in message
    assert "the model has 32 layers" in message


def test_overlap_names_both_ranges() -> None:
    message = _error("0-16,15-31")
    assert "'0-16' and '15-31' overlap on layers 15-16" in message


def test_overlap_of_non_neighbours_is_found() -> None:
    message = _error("0-10,11-20,5-31")
    assert "overlap" in message
    assert "'0-10'" in message and "'5-31'" in message


def test_gap_names_the_missing_layers() -> None:
    assert "layers 15-16 between '0-14' and '17-31' belong to no stage" in _error("0-14,17-31")
    assert "layer 15 between '0-14' and '16-31' belongs to no stage" in _error("0-14,16-31")


def test_must_start_at_layer_zero() -> None:
    message = _error("1-15,16-31")
    assert "does not start at layer 0" in message
    assert "layer 0 would belong to no stage" in message


def test_must_end_at_last_layer() -> None:
    message = _error("0-15,16-30", 32)
    assert "does not end at the model's last layer 31" in message
    assert "the model has 32 layers" in message


def test_ranges_must_be_in_stage_order() -> None:
    assert "not in layer order" in _error("16-31,0-15")


# -- check_layer_ranges without a layer count (cluster TOML) ---------------------------------


def test_shape_check_without_layer_count_accepts_any_end() -> None:
    check_layer_ranges([LayerRange(0, 10), LayerRange(10, 500)])


def test_shape_check_without_layer_count_still_finds_gaps() -> None:
    with pytest.raises(ValueError, match="belongs to no stage"):
        check_layer_ranges([LayerRange(0, 10), LayerRange(11, 20)])


def test_parse_layer_range_single() -> None:
    assert parse_layer_range("3-7") == LayerRange(3, 8)


# -- even_split ------------------------------------------------------------------------------


def test_even_split_gives_earlier_stages_the_extra_layer() -> None:
    assert format_pp_layers(even_split(30, 4)) == "0-7,8-15,16-22,23-29"


def test_even_split_exact() -> None:
    assert even_split(30, 2) == (LayerRange(0, 15), LayerRange(15, 30))


def test_even_split_rejects_zero_stages() -> None:
    with pytest.raises(ConfigurationError) as info:
        even_split(30, 0)
    assert info.value.source == "--pp-size"


def test_even_split_rejects_more_stages_than_layers() -> None:
    with pytest.raises(ConfigurationError) as info:
        even_split(30, 31)
    assert info.value.source == "--pp-size"
    assert "the model has 30 layers" in str(info.value)
    assert "--pp-size of at most 30" in str(info.value)


@given(st.integers(1, 400), st.data())
def test_even_split_invariants(num_layers: int, data: st.DataObject) -> None:
    stages = data.draw(st.integers(1, num_layers))
    ranges = even_split(num_layers, stages)
    assert len(ranges) == stages
    assert ranges[0].start == 0 and ranges[-1].end == num_layers
    assert all(a.end == b.start for a, b in zip(ranges, ranges[1:], strict=False))
    counts = [r.count for r in ranges]
    assert max(counts) - min(counts) <= 1
    assert counts == sorted(counts, reverse=True)
    # An even split is always a valid --pp-layers value for the same model.
    assert parse_pp_layers(format_pp_layers(ranges), num_layers) == ranges


# -- format / parse round trip ---------------------------------------------------------------


@st.composite
def _tilings(draw: st.DrawFn) -> tuple[int, tuple[LayerRange, ...]]:
    sizes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=12))
    ranges, start = [], 0
    for size in sizes:
        ranges.append(LayerRange(start, start + size))
        start += size
    return start, tuple(ranges)


@given(_tilings())
def test_format_then_parse_round_trips(tiling: tuple[int, tuple[LayerRange, ...]]) -> None:
    num_layers, ranges = tiling
    text = format_pp_layers(ranges)
    assert parse_pp_layers(text, num_layers) == ranges
    assert format_pp_layers(parse_pp_layers(text, num_layers)) == text
