"""The sampling fields of a request, checked at the edge: bounded, typed, OpenAI's rules, and
each error a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from mlxppd.http.errors import ApiError
from mlxppd.http.validation import parse_chat, parse_completion

CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}


def refused(body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_chat({**CHAT, **body})
    assert caught.value.status == 400
    return caught.value


def test_every_sampling_field_reaches_the_parsed_request() -> None:
    parsed = parse_chat(
        {
            **CHAT, "n": 3, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
            "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "logit_bias": {"50256": -100, "11": 2.5}, "logprobs": True, "top_logprobs": 5,
            "stop": "END",
        }
    )  # fmt: skip
    assert (parsed.n, parsed.top_k, parsed.min_p, parsed.repetition_penalty) == (3, 40, 0.05, 1.1)
    assert (parsed.presence_penalty, parsed.frequency_penalty) == (0.5, -0.5)
    assert parsed.logit_bias == ((11, 2.5), (50256, -100.0))
    assert (parsed.top_logprobs, parsed.stop) == (5, ("END",))
    legacy = parse_completion({"prompt": "hi", "logprobs": 3})
    assert legacy.logprobs and legacy.top_logprobs == 3


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {"1": True}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ],
)
def test_out_of_bounds_values_name_their_field(body: dict[str, Any], param: str) -> None:
    assert refused(body).param == param


def test_top_logprobs_needs_logprobs_as_openai_says() -> None:
    error = refused({"top_logprobs": 3})
    assert "top_logprobs needs logprobs" in error.message
