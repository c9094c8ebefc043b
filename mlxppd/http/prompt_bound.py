"""A prompt's length checked against the context before it is tokenized.

Tokenizing costs time in proportion to the text, however few tokens come out (a 3.8 MiB tool
list took the tokenizer thread 12 s), so a prompt too long for the context by its characters
alone is refused before it is tokenized: no token of the vocabulary decodes to more characters
than its longest one, so a text of more than context x that many characters cannot fit. What
passes is tokenized, and ``generation.choice_params`` checks the tokens.
"""

from __future__ import annotations

from typing import Any

from mlxppd.http.errors import invalid

#: per tokenizer object: the characters of its longest token (asked once)
_LONGEST: dict[int, int | None] = {}


def longest_token_chars(tokenizer: Any) -> int | None:
    """The characters of the tokenizer's longest token (special tokens included); None when
    the tokenizer cannot list its vocabulary (then no bound is known)."""
    key = id(tokenizer)
    if key not in _LONGEST:
        try:
            vocab = tokenizer.get_vocab()
            _LONGEST[key] = max(1, max((len(str(token)) for token in vocab), default=1))
        except Exception:  # a tokenizer without a vocabulary to list
            _LONGEST[key] = None
    return _LONGEST[key]


def check_prompt_chars(tokenizer: Any, text: str, context: int, param: str) -> None:
    """A 400 naming ``param`` when ``text`` has more characters than ``context`` tokens of
    this tokenizer can hold."""
    longest = longest_token_chars(tokenizer)
    if longest is not None and len(text) > context * longest:
        raise invalid(
            f"the prompt is {len(text)} characters; this model's maximum context length is "
            f"{context} tokens, which hold at most {context * longest} characters (its longest "
            f"token has {longest}); shorten the prompt",
            param,
            "context_length_exceeded",
        )


def bounded_tokens(tokenizer: Any, text: str, context: int, param: str, **encode: Any) -> list[int]:
    """``text`` tokenized (``encode``: the tokenizer's options), after ``check_prompt_chars``."""
    check_prompt_chars(tokenizer, text, context, param)
    return [int(t) for t in tokenizer.encode(text, **encode)]
