"""A generation backend with every stage in this process (``mlxppd serve`` without a cluster).

Each request keeps its own KV caches and sampler; its steps are queued on the one mlx thread,
so concurrent requests interleave token by token without touching the event loop.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

from mlxppd.core.cpu_weights import CpuWeights
from mlxppd.core.kv_admission import (
    UNLIMITED_BYTES,
    AdmissionRequest,
    StageKvManager,
    coordinated_admission,
)
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.profile.model import read_model_config
from mlxppd.core.stages import stage_specs
from mlxppd.engine.cpu_weights import resolve_for_process
from mlxppd.engine.families.base import text_config
from mlxppd.engine.kv_sizing import kv_bytes_per_token
from mlxppd.engine.pipeline import InProcessPipeline, StepOutput
from mlxppd.engine.sampling import SequenceSampler, constraint_for, make_sampler
from mlxppd.engine.stage import load_stage
from mlxppd.engine.tokenizer import load_tokenizer
from mlxppd.runtime.backends.contract import (
    AdmissionRejected,
    BackendUnavailable,
    Health,
    RequestRefused,
    SamplingParams,
    SequenceFailed,
    TokenEvent,
    independent_choices,
)
from mlxppd.runtime.system.mlx_thread import MlxThread


class InProcessBackend:
    def __init__(
        self,
        model_dir: Path,
        ranges: Sequence[LayerRange],
        mlx: MlxThread,
        model_id: str,
        kv_budget_bytes: int | None = None,
        max_sequences: int = 64,
        cpu_weights: CpuWeights = CpuWeights.AUTO,
    ) -> None:
        self._weights = cpu_weights
        self._model_dir = model_dir
        self._ranges = tuple(ranges)
        self._mlx = mlx
        self._model_id = model_id
        self._budget = kv_budget_bytes
        self._max_sequences = max_sequences
        self._pipeline: InProcessPipeline | None = None
        self._tokenizer: Any = None
        self.kv: list[StageKvManager] = []
        self._ids = itertools.count()

    async def start(self) -> None:
        def load() -> tuple[InProcessPipeline, Any, list[int]]:
            config = read_model_config(self._model_dir)
            weights, _ = resolve_for_process(self._weights, config)
            stages = [
                load_stage(self._model_dir, s, config, weights_mode=weights)
                for s in stage_specs(self._ranges)
            ]
            hidden = int(text_config(config)["hidden_size"])
            per_token = [kv_bytes_per_token(s, hidden) for s in stages]
            return InProcessPipeline(stages), load_tokenizer(self._model_dir), per_token

        self._pipeline, self._tokenizer, per_token = await self._mlx.run(load)
        self.kv = [
            StageKvManager(
                stage_index=i,
                budget_bytes=self._budget if self._budget is not None else UNLIMITED_BYTES,
                bytes_per_token=n,
                max_sequences=self._max_sequences,
            )
            for i, n in enumerate(per_token)
        ]

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def health(self) -> Health:
        if self._pipeline is None:
            return Health(ready=False, detail="loading")
        stages = tuple(
            {
                "stage": m.stage_index,
                "kv_used_bytes": m.used_bytes,
                "kv_budget_bytes": m.budget_bytes,
                "active_sequences": len(m.reserved),
            }
            for m in self.kv
        )
        return Health(ready=True, detail="in-process", stages=stages)

    def _steps(
        self, pipeline: InProcessPipeline, prompt: list[int], params: SamplingParams
    ) -> Iterator[StepOutput]:
        """The decode loop for ``params``: mlx-lm's look-ahead loop unless the sampler needs
        each token before the next step."""
        spec = params.sampler_spec(prompt)
        try:
            draw = make_sampler(
                params.temperature, params.top_p, params.seed,
                top_k=params.top_k, min_p=params.min_p,
            )  # fmt: skip
            vocab = pipeline.vocab_size()
            constraint = constraint_for(params.grammar, self.tokenizer, vocab or 0)
            sampler = SequenceSampler(draw, spec, vocab, constraint)
        except Exception as exc:
            raise RequestRefused(f"the sampler refused these parameters: {exc}") from None
        if sampler.processors or sampler.top_logprobs or sampler.constraint:
            return pipeline.generate_with(
                prompt, params.max_tokens, sampler, with_logprobs=params.logprobs
            )
        return pipeline.generate(prompt, params.max_tokens, draw, with_logprobs=params.logprobs)

    def generate_choices(
        self, request_id: str, prompt: list[int], params: Sequence[SamplingParams]
    ) -> list[AsyncIterator[TokenEvent]]:
        return independent_choices(self, request_id, prompt, params)

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        pipeline = self._pipeline
        if pipeline is None:
            raise BackendUnavailable("the model is still loading; retry shortly")
        seq_id = f"{request_id}-{next(self._ids)}"
        request = AdmissionRequest(seq_id, len(prompt), params.max_tokens)
        problem = coordinated_admission(self.kv, request)
        if problem is not None:
            raise AdmissionRejected(problem)
        try:
            steps = self._steps(pipeline, prompt, params)
            while True:
                try:
                    step = await self._mlx.run(lambda: next(steps, None))
                except Exception as exc:  # this request's forward or sampler: it alone fails
                    raise SequenceFailed(f"the model failed on this request: {exc}") from exc
                if step is None:
                    return
                yield TokenEvent(token=step.token, logprob=step.logprob, top=step.top)
        finally:
            for manager in self.kv:
                manager.release(seq_id)
