"""``mlxppd generate``: load the stages in one process and stream one completion."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import mlx.core as mx

from mlxppd.core.cpu_weights import CpuWeights, held_config, with_native_hint
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.generate_settings import GenerateSettings
from mlxppd.core.layer_ranges import format_pp_layers, parse_pp_layers
from mlxppd.core.partition.plan import (
    PartitionPlan,
    balance_layers,
    parse_stage_memory,
    plan_layers,
)
from mlxppd.core.partition.quality import quality_report
from mlxppd.core.profile.model import ModelProfile, profile_from_config, read_model_config
from mlxppd.core.stages import StageSpec, stage_specs
from mlxppd.engine.blas import blas_in_use
from mlxppd.engine.cpu_weights import resolve_for_process
from mlxppd.engine.families import family_for, single_process_reason
from mlxppd.engine.model_files import resolve_model_dir
from mlxppd.engine.pipeline import InProcessPipeline, make_sampler
from mlxppd.engine.stage import LoadedStage, load_stage
from mlxppd.engine.tensor_parallel import init_group, shard_stage, tp_refusal
from mlxppd.engine.tokenizer import encode_prompt, load_tokenizer

Log = Callable[[str], None]


@dataclass
class GenerateResult:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    stage_bytes: list[int] = field(default_factory=list)
    decode_tokens_per_s: float = 0.0


def plan_stages(
    settings: GenerateSettings, profile: ModelProfile, refusal: str | None = None
) -> PartitionPlan:
    """The plan the flags ask for: ``--pp-layers`` as given (validated, adjacency included),
    otherwise the auto partitioner over ``--pp-size`` stages (one when neither is given).

    ``refusal`` (default: the profile's) says why the model cannot be split; asking for more
    than one stage of such a model is an error."""
    refusal = refusal or profile.pipeline_refusal
    budgets = None
    if settings.pp_layers is not None:
        ranges = parse_pp_layers(settings.pp_layers, profile.num_layers, profile.adjacency_groups)
        if refusal and len(ranges) > 1:
            raise ConfigurationError(refusal, source="--pp-layers")
        if settings.stage_memory is not None:
            budgets = parse_stage_memory(settings.stage_memory, len(ranges))
        return plan_layers(profile, ranges, budgets)
    num_stages = settings.pp_size or 1
    if refusal and num_stages > 1:
        raise ConfigurationError(refusal, source="--pp-size")
    if settings.stage_memory is not None:
        budgets = parse_stage_memory(settings.stage_memory, num_stages)
    return balance_layers(profile, num_stages, budgets)


def check_tensor_parallel(settings: GenerateSettings) -> None:
    """Refuse ``--tp-size`` for a model whose stages cannot be sharded that way."""
    config = read_model_config(resolve_model_dir(settings.model))
    refusal = tp_refusal(config, settings.tp_size)
    if refusal is not None:
        raise ConfigurationError(refusal, source="--tp-size")


def load_pipeline(
    model_dir: Path,
    specs: tuple[StageSpec, ...],
    log: Log,
    weights: CpuWeights = CpuWeights.NATIVE,
    adapter: Path | None = None,
) -> InProcessPipeline:
    config = read_model_config(model_dir)
    stages: list[LoadedStage] = []
    for spec in specs:
        started = time.perf_counter()
        stage = load_stage(model_dir, spec, config, weights_mode=weights, adapter=adapter)
        log(
            f"stage {spec.index}/{spec.num_stages}: layers {spec.start}-{spec.end - 1}, "
            f"{stage.parameter_bytes / 1e6:.1f} MB of {stage.weights} parameters, "
            f"loaded in {time.perf_counter() - started:.2f} s"
        )
        fused = stage.adapters.fused if stage.adapters is not None else None
        if fused is not None:
            log(
                f"stage {spec.index}: adapter {fused.path} ({fused.kind}) fused into "
                f"{fused.modules} modules, {fused.read} of its {fused.stored} tensors read"
            )
        stages.append(stage)
    return InProcessPipeline(stages)


def run_generate(
    settings: GenerateSettings, out: TextIO = sys.stdout, log: Log | None = None
) -> GenerateResult:
    """Generate one completion, streaming text to ``out`` (or one JSON object with --json)."""
    say: Log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    model_dir = resolve_model_dir(settings.model, progress=say)
    config = read_model_config(model_dir)
    num_layers = family_for(config).num_layers(config)
    weights, why = resolve_for_process(settings.cpu_weights, config)
    refusal = single_process_reason(config)
    # The plan prices the weights as the stages will hold them.
    profile = profile_from_config(held_config(config, weights))
    if profile.num_layers != num_layers:
        raise RuntimeError(
            f"the model profile counts {profile.num_layers} layers but the stage executor "
            f"builds {num_layers}; the profile of model_type {profile.model_type!r} is wrong"
        )
    try:
        plan = plan_stages(settings, profile, refusal)
    except ConfigurationError as exc:
        # auto never turns budgets the checkpoint fits into an error: it keeps the native size.
        if settings.cpu_weights is not CpuWeights.AUTO or weights is CpuWeights.NATIVE:
            raise with_native_hint(exc, weights) from None
        weights, why = CpuWeights.NATIVE, "native (auto: float32 weights do not fit --stage-memory)"
        plan = plan_stages(settings, profile_from_config(config), refusal)
    how = "auto-partitioned by bytes" if plan.auto else "from --pp-layers"
    say(f"model {model_dir} ({num_layers} layers), stages {format_pp_layers(plan.ranges)} ({how})")
    say(f"weights: {why}; BLAS: {blas_in_use()}")
    for warning in plan.warnings:
        say(f"warning: {warning}")
    group = None
    if settings.tp_size > 1:
        check_tensor_parallel(settings)
        group = init_group(settings.tp_size)
        say(f"tensor-parallel rank {group.rank()} of {group.size()} (MLX ring backend)")
    adapter = Path(settings.adapter).expanduser() if settings.adapter else None
    pipeline = load_pipeline(model_dir, stage_specs(plan.ranges), say, weights, adapter)
    if group is not None:
        pipeline = InProcessPipeline([shard_stage(s, group) for s in pipeline.stages])
        shares = ", ".join(f"{s.parameter_bytes / 1e6:.1f}" for s in pipeline.stages)
        say(f"rank {group.rank()} holds its shard of every stage: {shares} MB")
    if settings.verbose:
        loaded = [stage.parameter_bytes for stage in pipeline.stages]
        say(quality_report(plan).with_actual(loaded).format())
    tokenizer = load_tokenizer(model_dir)
    prompt = encode_prompt(tokenizer, settings.prompt, chat_template=settings.chat_template)
    if settings.seed is not None:
        mx.random.seed(settings.seed)
    sampler = make_sampler(settings.temp, settings.top_p)

    result = GenerateResult(prompt_tokens=len(prompt))
    result.stage_bytes = [s.parameter_bytes for s in pipeline.stages]
    detok = tokenizer.detokenizer
    detok.reset()
    eos = set(tokenizer.eos_token_ids)
    first_token_at = None
    for step in pipeline.generate(prompt, settings.max_tokens, sampler):
        if first_token_at is None:
            first_token_at = time.perf_counter()
        if step.token in eos:
            break
        result.tokens.append(step.token)
        detok.add_token(step.token)
        if not settings.json_output:
            out.write(detok.last_segment)
            out.flush()
    detok.finalize()
    result.text = detok.text
    if not settings.json_output:
        out.write(detok.last_segment + "\n")
    else:
        out.write(json.dumps({"tokens": result.tokens, "text": result.text}) + "\n")
    out.flush()
    if first_token_at is not None and len(result.tokens) > 1:
        elapsed = time.perf_counter() - first_token_at
        result.decode_tokens_per_s = (len(result.tokens) - 1) / max(elapsed, 1e-9)
        say(f"{len(result.tokens)} tokens, decode {result.decode_tokens_per_s:.1f} tokens/s")
    return result
