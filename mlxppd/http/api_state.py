"""The OpenAI-compatible app's state: what every handler (OpenAI and Anthropic routes) reads."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aiohttp import web

from mlxppd.runtime.backends.contract import GenerationBackend
from mlxppd.runtime.observability.metrics import PipelineMetrics

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

    def context(self) -> int | None:
        if self.context_tokens is not None:
            return self.context_tokens
        known = getattr(self.backend.tokenizer, "model_max_length", None)
        if isinstance(known, int) and 0 < known < _CONTEXT_SANITY:
            return known
        return None


STATE = web.AppKey("mlxpp_openai_state", ApiState)
