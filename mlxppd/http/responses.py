"""OpenAI's response objects: chat.completion, chat.completion.chunk and text_completion.

A request has one choice per ``n``; each chunk carries one choice, by its ``index``. The usage
counts the prompt once (its prefill is shared) and every choice's completion tokens.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from mlxppd.http.completion import Generation, Piece, TokenInfo
from mlxppd.http.tools import ToolPlan


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class Shape:
    """OpenAI's response and chunk objects for one request."""

    def __init__(
        self, chat: bool, model: str, logprobs: bool, tools: ToolPlan | None = None
    ) -> None:
        self.chat = chat
        self.model = model
        self.logprobs = logprobs
        #: the request's tools: a chat choice's text splits into content and tool calls
        self.tools = tools or ToolPlan()
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _head(self, stream: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        else:
            kind = "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def _logprobs(self, tokens: list[TokenInfo]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            content = [
                {
                    "token": t.text,
                    "logprob": t.logprob,
                    "bytes": _bytes(t.text),
                    "top_logprobs": [
                        {"token": text, "logprob": lp, "bytes": _bytes(text)}
                        for text, lp in t.top or ()
                    ],
                }
                for t in tokens
            ]
            return {"content": content, "refusal": None}
        return {
            "tokens": [t.text for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            # Legacy completions: text -> logprob per position (equal texts keep the first).
            "top_logprobs": [{text: lp for text, lp in reversed(t.top or ())} for t in tokens],
            "text_offset": [t.text_offset for t in tokens],
        }

    @staticmethod
    def _usage(gens: Sequence[Generation]) -> dict[str, Any]:
        prompt = gens[0].prompt_tokens if gens else 0
        completion = sum(g.completion_tokens for g in gens)
        cached = gens[0].cached_tokens if gens else 0
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # The prompt tokens the stages took from a kept prefix (the prompt cache).
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def complete(self, results: Sequence[tuple[Generation, list[TokenInfo]]]) -> dict[str, Any]:
        choices = []
        for index, (gen, tokens) in enumerate(results):
            choice: dict[str, Any] = {"index": index}
            finish = gen.finish_reason
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": gen.text}
                if self.tools.active:
                    cut = finish == "length"
                    content, calls = self.tools.finish(gen.text, cut)
                    message["content"] = content
                    if calls:
                        message["tool_calls"] = [c.as_dict() for c in calls]
                        finish = "length" if cut else "tool_calls"  # as OpenAI: cut, it says so
                choice["message"] = {**message, "refusal": None}
            else:
                choice["text"] = gen.text
            choice["logprobs"] = self._logprobs(tokens)
            choice["finish_reason"] = finish
            choices.append(choice)
        usage = self._usage([gen for gen, _ in results])
        return {**self._head(False), "choices": choices, "usage": usage}

    def role_chunk(self, include_usage: bool, index: int = 0) -> dict[str, Any] | None:
        if not self.chat:
            return None
        delta = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._chunk_of(choice, include_usage)

    def chunk(
        self, piece: Piece, finish: str | None, include_usage: bool, index: int = 0
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {"content": piece.text} if finish is None else {}
        else:
            choice["text"] = piece.text
        choice["logprobs"] = self._logprobs(piece.tokens) if piece.tokens else None
        choice["finish_reason"] = finish
        return self._chunk_of(choice, include_usage)

    def calls_chunk(
        self, gen: Generation, include_usage: bool, index: int = 0
    ) -> tuple[dict[str, Any] | None, str]:
        """Streaming with tools, at a choice's end: the chunk carrying its tool calls (None
        when it made none) and its finish reason."""
        cut = gen.finish_reason == "length"
        _, calls = self.tools.finish(gen.text, cut)
        if not calls:
            return None, gen.finish_reason
        deltas = [{"index": i, **call.as_dict()} for i, call in enumerate(calls)]
        choice = {"index": index, "delta": {"tool_calls": deltas}, "logprobs": None,
                  "finish_reason": None}  # fmt: skip
        return self._chunk_of(choice, include_usage), "length" if cut else "tool_calls"

    def _chunk_of(self, choice: dict[str, Any], include_usage: bool) -> dict[str, Any]:
        chunk = {**self._head(True), "choices": [choice]}
        if include_usage:  # OpenAI sends usage: null on every chunk but the last
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, gens: Sequence[Generation]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": self._usage(gens)}
