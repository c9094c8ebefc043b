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

from mlxppd.core.generate_settings import GenerateSettings
from mlxppd.core.layer_ranges import LayerRange, even_split, format_pp_layers, parse_pp_layers
from mlxppd.core.stages import StageSpec, stage_specs
from mlxppd.engine.families import family_for
from mlxppd.engine.model_files import read_config, resolve_model_dir
from mlxppd.engine.pipeline import InProcessPipeline, make_sampler
from mlxppd.engine.stage import LoadedStage, load_stage
from mlxppd.engine.tokenizer import encode_prompt, load_tokenizer

Log = Callable[[str], None]


@dataclass
class GenerateResult:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    stage_bytes: list[int] = field(default_factory=list)
    decode_tokens_per_s: float = 0.0


def resolve_ranges(settings: GenerateSettings, num_layers: int) -> tuple[LayerRange, ...]:
    """The stage layer ranges the flags ask for (one stage when neither flag is given)."""
    if settings.pp_layers is not None:
        return parse_pp_layers(settings.pp_layers, num_layers)
    return even_split(num_layers, settings.pp_size or 1)


def load_pipeline(model_dir: Path, specs: tuple[StageSpec, ...], log: Log) -> InProcessPipeline:
    config = read_config(model_dir)
    stages: list[LoadedStage] = []
    for spec in specs:
        started = time.perf_counter()
        stage = load_stage(model_dir, spec, config)
        log(
            f"stage {spec.index}/{spec.num_stages}: layers {spec.start}-{spec.end - 1}, "
            f"{stage.parameter_bytes / 1e6:.1f} MB of parameters, "
            f"loaded in {time.perf_counter() - started:.2f} s"
        )
        stages.append(stage)
    return InProcessPipeline(stages)


def run_generate(
    settings: GenerateSettings, out: TextIO = sys.stdout, log: Log | None = None
) -> GenerateResult:
    """Generate one completion, streaming text to ``out`` (or one JSON object with --json)."""
    say: Log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    model_dir = resolve_model_dir(settings.model, progress=say)
    config = read_config(model_dir)
    num_layers = family_for(config).num_layers(config)
    ranges = resolve_ranges(settings, num_layers)
    say(f"model {model_dir} ({num_layers} layers), stages {format_pp_layers(ranges)}")
    pipeline = load_pipeline(model_dir, stage_specs(ranges), say)
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
