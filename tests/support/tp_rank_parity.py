"""One rank of a tensor-parallel parity run (``python -m tests.support.tp_rank_parity``, started by
tests/engine/test_tensor_parallel.py with MLX's launch variables): the same greedy tokens computed
twice on this rank's shard, by mlxpp's stages (``--pp-layers``, each ``shard_stage``-d) and by
mlx-lm's own model with its own ``shard()``. Rank 0 prints ``{"ours": [...], "theirs": [...]}``.

Arguments: MODEL_DIR PP_LAYERS TP MAX_TOKENS PROMPT_IDS_JSON [theirs] (theirs: mlx-lm's run
only, for a test that gets its own side from ``mlxppd generate``). MODEL_DIR may name several
models joined by ``os.pathsep``: one ring runs them in turn, rank 0 printing a line for each."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

from mlxppd.core.layer_ranges import parse_pp_layers
from mlxppd.core.profile.model import read_model_config
from mlxppd.core.stages import stage_specs
from mlxppd.engine.pipeline import InProcessPipeline
from mlxppd.engine.stage import load_stage
from mlxppd.engine.tensor_parallel import init_group, shard_stage
from tests.support.references import load_reference_model, served_weights


def main() -> None:
    model_dirs, layers, tp, count, prompt = (
        sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
    )  # fmt: skip
    group = init_group(tp)
    for model_dir in model_dirs.split(os.pathsep):
        run(Path(model_dir), layers, group, count, prompt)


def run(
    model_dir: Path, layers: str, group: mx.distributed.Group, count: int, prompt: list[int]
) -> None:
    config = read_model_config(model_dir)
    weights = served_weights(model_dir)
    specs = stage_specs(parse_pp_layers(layers, int(config["num_hidden_layers"])))
    stages = (
        []
        if sys.argv[6:] == ["theirs"]
        else [
            shard_stage(load_stage(model_dir, s, config, weights_mode=weights), group)
            for s in specs
        ]
    )
    only_theirs = sys.argv[6:] == ["theirs"]
    ours = (
        [] if only_theirs else [t.token for t in InProcessPipeline(stages).generate(prompt, count)]
    )
    model = load_reference_model(model_dir)
    model.shard(group)
    theirs = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=count)]
    if group.rank() == 0:
        print(json.dumps({"ours": ours, "theirs": theirs}), flush=True)


if __name__ == "__main__":
    main()
