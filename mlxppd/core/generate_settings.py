"""Settings of ``mlxppd generate``: what the CLI parsed, validated, handed to the runtime."""

from __future__ import annotations

from pydantic import Field, model_validator

from mlxppd.core.cpu_weights import CpuWeights
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.strict import StrictModel


class GenerateSettings(StrictModel):
    """One in-process pipeline generation."""

    model: str | None = Field(None, description="model directory or HF id; None = embedded model")
    prompt: str = Field(..., description="the prompt text")
    max_tokens: int = Field(256, ge=1, description="most tokens to generate (tokens)")
    temp: float = Field(0.0, ge=0.0, description="sampling temperature; 0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass (fraction)")
    seed: int | None = Field(None, description="random seed for sampling; None = unseeded")
    pp_size: int | None = Field(
        None, ge=1, description="number of stages; layers balanced by parameter bytes"
    )
    pp_layers: str | None = Field(
        None, description="inclusive layer ranges per stage, '0-14,15-29'"
    )
    tp_size: int = Field(
        1, ge=1, le=64, description="tensor-parallel ranks per stage (processes on this host)"
    )
    stage_memory: str | None = Field(
        None, description="memory budget per stage, '64GiB,16GiB'; one size for all stages"
    )
    cpu_weights: CpuWeights = Field(
        CpuWeights.AUTO, description="weights on a CPU host: auto, native or float32"
    )
    adapter: str | None = Field(
        None, description="LoRA adapter directory fused into the stages' weights; None = none"
    )
    verbose: bool = Field(False, description="log the partition quality report once loaded")
    chat_template: bool = Field(True, description="wrap the prompt in the model's chat template")
    json_output: bool = Field(False, description="print one JSON object instead of streaming text")

    @model_validator(mode="after")
    def _one_split_flag(self) -> GenerateSettings:
        if self.pp_size is not None and self.pp_layers is not None:
            raise ConfigurationError(
                "give either --pp-size or --pp-layers, not both "
                "(--pp-layers fixes the stage count)",
                source="--pp-layers",
            )
        if self.adapter is not None and self.tp_size > 1:
            raise ConfigurationError(
                "adapters run on stages of one rank; drop --adapter or --tp-size",
                source="--adapter",
            )
        return self
