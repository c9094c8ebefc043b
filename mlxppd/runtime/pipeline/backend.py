"""What the HTTP layer needs from whatever runs the model: the generation backend contract.

The coordinator (stages in other processes) and the in-process backend (all stages here) both
implement it, so the OpenAI API is one piece of code over either.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from mlxppd.core.errors import MlxppError, PermanentError, TemporaryError
from mlxppd.core.kv_admission import AdmissionDiagnostic


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    """most tokens to generate (tokens)"""
    temperature: float = 0.0
    """0 is greedy"""
    top_p: float = 1.0
    """nucleus sampling mass (fraction)"""
    seed: int | None = None
    """per-request random seed; None = unseeded"""
    logprobs: bool = False
    """return the log-probability of each sampled token"""


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token (and its log-probability when asked for)."""

    token: int
    logprob: float | None = None


@dataclass(frozen=True)
class Health:
    ready: bool
    detail: str
    stages: tuple[dict[str, Any], ...] = field(default_factory=tuple)


class AdmissionRejected(TemporaryError):
    """Some stage cannot hold the request's KV cache now (HTTP 503 with the diagnostic)."""

    def __init__(self, diagnostic: AdmissionDiagnostic):
        self.diagnostic = diagnostic
        super().__init__(diagnostic.message())


class BackendUnavailable(MlxppError):
    """The pipeline is not (or no longer) able to serve: a stage is down or not yet warm."""


class AdmissionClosed(BackendUnavailable):
    """Admission is stopped on purpose (drain, reload, shutdown): retry after ``retry_after_s``."""

    def __init__(self, reason: str, retry_after_s: int = 2):
        self.retry_after_s = retry_after_s
        super().__init__(reason)


class SequenceFailed(PermanentError):
    """This one sequence could not be computed (a stage's forward or sampler failed on it).

    The pipeline and every other request carry on; the client gets a 500 with the reason.
    """


class RequestRefused(PermanentError):
    """A stage refused this request's parameters at admission (HTTP 400); nothing was run."""


class GenerationBackend(Protocol):
    @property
    def model_id(self) -> str: ...

    @property
    def tokenizer(self) -> Any:
        """mlx-lm's TokenizerWrapper: chat template, detokenizer, EOS ids."""
        ...

    def health(self) -> Health: ...

    def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        """Stream sampled tokens until max_tokens or EOS (EOS is yielded too).

        Raises AdmissionRejected before the first token when a stage has no room,
        RequestRefused when a stage refuses the parameters, SequenceFailed when a stage fails
        on this sequence alone, and BackendUnavailable when the pipeline breaks. Closing the
        iterator early (client gone) releases the sequence's KV cache on every stage.
        """
        ...
