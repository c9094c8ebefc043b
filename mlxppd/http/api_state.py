"""The HTTP app's state: what the base app's middleware and every API's handlers read."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from mlxppd.core.fair_share import DEFAULT_MAX_CHOICES_PER_REQUEST
from mlxppd.http.errors import OPENAI_ERRORS, ErrorShape
from mlxppd.http.sequence_gate import SequenceGate
from mlxppd.runtime.backends.contract import BackendUnavailable, GenerationBackend
from mlxppd.runtime.observability.metrics import PipelineMetrics

T = TypeVar("T")

#: requests handled at once; more get a 503 with Retry-After (the KV budget admits fewer)
DEFAULT_MAX_IN_FLIGHT = 256
#: stream events held for a client reading slower than the model writes (``http/sse.py``)
DEFAULT_STREAM_BUFFER_EVENTS = 64
#: seconds a stream's buffer may stay full before its client counts as stopped: a slow reader
#: on a busy host catches up within it, one that stopped reading is cut after it
DEFAULT_STREAM_STALL_S = 5.0
#: a stream's kernel send buffer (the kernel doubles it): without a cap a client that does not
#: read has the kernel hold megabytes for it before the server notices
DEFAULT_STREAM_SEND_BUFFER_BYTES = 16 * 1024
#: a request body over this many bytes is rendered and tokenized on the bulk lane, so a huge
#: prompt never waits in front of the small ones
BULK_INPUT_BYTES = 64 * 1024
BULK_THREAD = "mlxpp-tokenize-bulk"
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
    stream_buffer_events: int = DEFAULT_STREAM_BUFFER_EVENTS
    stream_stall_s: float = DEFAULT_STREAM_STALL_S
    stream_send_buffer_bytes: int = DEFAULT_STREAM_SEND_BUFFER_BYTES
    in_flight: int = 0
    max_choices_per_request: int = DEFAULT_MAX_CHOICES_PER_REQUEST
    #: the cap on sequences in flight, shared fairly between clients (None: uncapped)
    sequences: SequenceGate | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    #: one thread for small inputs and one for bulk ones (``BULK_INPUT_BYTES``): tokenizing
    #: must not stall the event loop, nor a huge prompt every small one. Encoding only reads a
    #: tokenizer (nothing here sets its truncation or padding), so the two may run at once.
    tokenize: ThreadPoolExecutor | None = None
    tokenize_bulk: ThreadPoolExecutor | None = None
    #: the hosts the app's listeners are bound to (``note_listener``): a Host header may name
    #: them when no key is set (``http/same_origin.py``)
    listen_hosts: set[str] = field(default_factory=set)
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

    async def off_loop(self, fn: Callable[[], T], size: int = 0) -> T:
        """``fn()``, the work on an input of ``size`` bytes, on a tokenizer thread away from the
        event loop: the bulk lane when ``size`` is over ``BULK_INPUT_BYTES``."""
        lane = self.tokenize_bulk if size > BULK_INPUT_BYTES else self.tokenize
        return await asyncio.get_running_loop().run_in_executor(lane, fn)

    def error_shape(self, path: str) -> ErrorShape:
        """How an error answering ``path`` is written."""
        for root, shape in self.error_shapes.items():
            if path == root or path.startswith(root + "/"):
                return shape
        return OPENAI_ERRORS


STATE = web.AppKey("mlxpp_openai_state", ApiState)
