"""OpenAI's response objects: chat.completion, chat.completion.chunk and text_completion."""

from __future__ import annotations

import time
import uuid
from typing import Any

from mlxppd.http.completion import Generation, Piece, TokenInfo


class Shape:
    """OpenAI's response and chunk objects for one request."""

    def __init__(self, chat: bool, model: str, logprobs: bool) -> None:
        self.chat = chat
        self.model = model
        self.logprobs = logprobs
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
                    "bytes": list(t.text.encode("utf-8")),
                    "top_logprobs": [],
                }
                for t in tokens
            ]
            return {"content": content, "refusal": None}
        return {
            "tokens": [t.text for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{} for _ in tokens],
            "text_offset": [t.text_offset for t in tokens],
        }

    @staticmethod
    def _usage(gen: Generation) -> dict[str, int]:
        return {
            "prompt_tokens": gen.prompt_tokens,
            "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        }

    def complete(self, gen: Generation, tokens: list[TokenInfo]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": gen.text, "refusal": None}
        else:
            choice["text"] = gen.text
        choice["logprobs"] = self._logprobs(tokens)
        choice["finish_reason"] = gen.finish_reason
        return {**self._head(False), "choices": [choice], "usage": self._usage(gen)}

    def role_chunk(self, include_usage: bool) -> dict[str, Any] | None:
        if not self.chat:
            return None
        delta = {"role": "assistant", "content": ""}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._chunk_of(choice, include_usage)

    def chunk(self, piece: Piece, finish: str | None, include_usage: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": piece.text} if finish is None else {}
        else:
            choice["text"] = piece.text
        choice["logprobs"] = self._logprobs(piece.tokens) if piece.tokens else None
        choice["finish_reason"] = finish
        return self._chunk_of(choice, include_usage)

    def _chunk_of(self, choice: dict[str, Any], include_usage: bool) -> dict[str, Any]:
        chunk = {**self._head(True), "choices": [choice]}
        if include_usage:  # OpenAI sends usage: null on every chunk but the last
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, gen: Generation) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": self._usage(gen)}
