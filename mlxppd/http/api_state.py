"""The HTTP app's state: what the base app's middleware and every API's handlers read."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from mlxppd.http.errors import OPENAI_ERRORS, ErrorShape
from mlxppd.runtime.backends.contract import BackendUnavailable, GenerationBackend
from mlxppd.runtime.observability.metrics import PipelineMetrics

T = TypeVar("T")

#: requests handled at once; more get a 503 with Retry-After (the KV budget admits fewer)
DEFAULT_MAX_IN_FLIGHT = 256
#: seconds a client has to send its whole body once the headers are in
DEFAULT_BODY_TIMEOUT_S = 30.0
#: tokenizers report ~1e30 when they do not know the context; above this we treat it as unknown
_CONTEXT_SANITY = 10_000_000


@dataclass
class ApiState:
    backend: GenerationBackend
    model_name: str
    api_key: bytes | None
    context_tokens: int | None
    default_max_tokens: int
    max_body_bytes: int
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    in_flight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    #: one thread: tokenizing a 4 MiB prompt must not stall the event loop, and one worker
    #: keeps HF tokenizers from being mutated from two threads at once
    tokenize: ThreadPoolExecutor | None = None
    #: request counters (None: metrics off)
    metrics: PipelineMetrics | None = None
    #: per path root (that path and those below it): the error shape of the API served there;
    #: OpenAI's everywhere else
    error_shapes: dict[str, ErrorShape] = field(default_factory=dict)

    def context(self) -> int | None:
        if self.context_tokens is not None:
            return self.context_tokens
        known = getattr(self.backend.tokenizer, "model_max_length", None)
        if isinstance(known, int) and 0 < known < _CONTEXT_SANITY:
            return known
        return None

    def loaded_tokenizer(self) -> Any:
        """The backend's tokenizer; a 503 while the model is still loading."""
        tokenizer = self.backend.tokenizer
        if tokenizer is None:
            raise BackendUnavailable("the model is still loading; retry shortly")
        return tokenizer

    async def off_loop(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the tokenizer thread (``tokenize``), away from the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize, fn)

    def error_shape(self, path: str) -> ErrorShape:
        """How an error answering ``path`` is written."""
        for root, shape in self.error_shapes.items():
            if path == root or path.startswith(root + "/"):
                return shape
        return OPENAI_ERRORS


STATE = web.AppKey("mlxpp_openai_state", ApiState)
