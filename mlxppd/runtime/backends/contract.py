"""What the HTTP layer needs from whatever runs the model: the generation backend contract.

The coordinator (stages in other processes) and the in-process backend (all stages here) both
implement it, so the OpenAI API is one piece of code over either.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mlxppd.core.errors import MlxppError, PermanentError, TemporaryError
from mlxppd.core.kv_admission import AdmissionDiagnostic
from mlxppd.core.protocol.sampling import PENALTY_CONTEXT, GrammarSpec, SamplerSpec


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
    top_k: int = 0
    """keep the k most likely tokens (0: all)"""
    min_p: float = 0.0
    """drop tokens less likely than min_p x the most likely one (0: off)"""
    repetition_penalty: float | None = None
    """mlx-lm's multiplicative penalty over the last 20 tokens (None: off)"""
    presence_penalty: float = 0.0
    """subtracted once from the logit of each token among the last 20"""
    frequency_penalty: float = 0.0
    """subtracted per occurrence among the last 20 tokens"""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, value added to its logit)"""
    top_logprobs: int = 0
    """the most likely tokens to report with each sampled one (0: none)"""
    grammar: GrammarSpec | None = None
    """constrain the output to JSON (a schema, or any object)"""
    adapter: str | None = None
    """the per-request LoRA adapter the sequence runs (None: the base model)"""

    def sampler_spec(self, prompt: Sequence[int]) -> SamplerSpec | None:
        """What the last stage needs beyond temperature, top_p and the seed; None: nothing."""
        spec = SamplerSpec(
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=list(self.logit_bias),
            top_logprobs=self.top_logprobs,
            grammar=self.grammar,
        )
        if spec == SamplerSpec():
            return None
        if spec.penalizes:
            spec = spec.model_copy(update={"context": list(prompt[-PENALTY_CONTEXT:])})
        return spec


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token (and its log-probability when asked for)."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None
    """the most likely tokens and their logprobs, most likely first (top_logprobs)"""
    cached: int | None = None
    """first token only: prompt tokens taken from a kept prefix instead of computed"""


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

    def generate_choices(
        self, request_id: str, prompt: list[int], params: Sequence[SamplingParams]
    ) -> list[AsyncIterator[TokenEvent]]:
        """One stream per choice of one prompt (``n``), as ``generate`` yields them; the
        backend may compute the prompt once for all. Iterate the streams together: a choice
        may wait for the others to start."""
        ...


def independent_choices(
    backend: GenerationBackend,
    request_id: str,
    prompt: list[int],
    params: Sequence[SamplingParams],
) -> list[AsyncIterator[TokenEvent]]:
    """``generate_choices`` as separate generations (each prefills the prompt itself)."""
    return [backend.generate(request_id, prompt, p) for p in params]
