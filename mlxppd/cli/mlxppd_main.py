"""``mlxppd``: the daemon's command line (agent, check, serve, generate, models)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from mlxppd import __version__
from mlxppd.cli import agent_command, serve_command
from mlxppd.cli.common import cpu_weights_flag, run_guarded

_DESCRIPTION = """\
mlxpp serves one MLX language model split by layers across several hosts.

commands:
  agent         (the default) run this host's node from the config directory
                (/etc/mlxpp: cluster.toml + mlxppd.toml); reconciles on change and SIGHUP
  check         validate the config directory without starting anything
  serve         serve the model: a local cluster (--pp-size N), one node of a cluster
                (--distributed-config TOML --node-id ID), or every stage in-process;
                the coordinator speaks the OpenAI API
  generate      run every pipeline stage in this process and stream one completion
  models path   print the local mlx-lm directory of a model (the embedded default:
                SmolLM2-135M-Instruct, converted from its GGUF on first use)
"""


def _generate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "generate",
        help="in-process pipeline generation",
        description=(
            "Load the model as pipeline stages in one process (each stage reads only its own "
            "weights and keeps its own KV caches) and stream the completion to stdout. "
            "Progress goes to stderr."
        ),
        epilog=(
            'example: mlxppd generate --pp-size 2 --prompt "What is the capital of France?"\n'
            "         mlxppd generate --pp-layers 0-0,1-28,29-29 --max-tokens 64 --json -p Hi\n"
            "         mlxppd generate --pp-size 2 --tp-size 3 -p Hi"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-m", "--model", help="mlx-lm model directory (default: the embedded model)")
    p.add_argument("-p", "--prompt", required=True, help="prompt text")
    p.add_argument("-n", "--max-tokens", type=int, default=256, help="most tokens (default 256)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    p.add_argument("--seed", type=int, help="random seed for sampling")
    split = p.add_mutually_exclusive_group()
    split.add_argument(
        "--pp-size",
        type=int,
        help="number of stages; layers are balanced by parameter bytes (auto partitioner)",
    )
    split.add_argument("--pp-layers", help='inclusive layer range per stage, e.g. "0-14,15-29"')
    p.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel ranks per stage (default 1): T processes on this host, each "
        "holding its shard of every stage (mlx-lm's shard()), joined by MLX's ring backend",
    )
    p.add_argument(
        "--stage-memory",
        metavar="SIZES",
        help="memory budget per stage, e.g. 8GiB,4GiB (one size: every stage); the auto "
        "partitioner keeps each stage within it, --pp-layers plans are checked against it",
    )
    cpu_weights_flag(p)
    p.add_argument(
        "--adapter",
        metavar="DIR",
        help="LoRA or DoRA adapter directory (mlx_lm lora's adapter_config.json + "
        "adapters.safetensors, or PEFT's adapter_model.safetensors): each stage reads its own "
        "layers' tensors and fuses them into its weights",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log the partition quality report (estimated vs loaded bytes per stage)",
    )
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    p.add_argument(
        "--json", action="store_true", help='print {"tokens": [...], "text": "..."} at the end'
    )


def _models_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("models", help="model utilities")
    msub = p.add_subparsers(dest="models_command", metavar="COMMAND", required=True)
    path = msub.add_parser(
        "path",
        help="print a model's local directory",
        description="Print the local mlx-lm directory of --model (default: the embedded "
        "model, converted into the model cache on first use; progress goes to stderr).",
    )
    path.add_argument("-m", "--model", help="model directory or id (default: embedded)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxppd",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mlxppd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _generate_parser(sub)
    _models_parser(sub)
    agent_command.register(sub)
    serve_command.register(sub)
    return parser


def _generate(args: argparse.Namespace) -> int:
    import os

    from mlxppd.core.generate_settings import GenerateSettings
    from mlxppd.runtime.generate import check_tensor_parallel, run_generate
    from mlxppd.runtime.tensor_ranks import is_rank_process, launch_ranks

    settings = GenerateSettings(
        model=args.model,
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        temp=args.temp,
        top_p=args.top_p,
        seed=args.seed,
        pp_size=args.pp_size,
        pp_layers=args.pp_layers,
        tp_size=args.tp_size,
        stage_memory=args.stage_memory,
        cpu_weights=args.cpu_weights,
        adapter=args.adapter,
        verbose=args.verbose,
        chat_template=not args.no_chat_template,
        json_output=args.json,
    )
    if settings.tp_size > 1 and not is_rank_process(os.environ):
        check_tensor_parallel(settings)  # refused here, once, before any rank starts
        return launch_ranks(sys.argv[1:], settings.tp_size, settings.seed)
    run_generate(settings)
    return 0


def _models_path(args: argparse.Namespace) -> int:
    from mlxppd.engine.model_files import resolve_model_dir

    path = resolve_model_dir(args.model, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(path)
    return 0


def _on_fast_blas(body: Callable[[], int]) -> Callable[[], int]:
    """Every mlxppd command computes with mlx: put the optimized BLAS under it first."""

    def run() -> int:
        from mlxppd.engine.blas import use_optimized_blas

        use_optimized_blas()
        return body()

    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from mlxppd.engine.mlx_lm_import import skip_package_init

    # mlxppd never takes names from mlx-lm's package itself: skip its __init__ (and
    # transformers until a tokenizer is needed; a stage never needs one).
    skip_package_init()
    if args.command == "generate":
        return run_guarded("mlxppd", _on_fast_blas(lambda: _generate(args)))
    if args.command == "models":
        return run_guarded("mlxppd", _on_fast_blas(lambda: _models_path(args)))
    if args.command is None:
        args = agent_command.default_args()
    func = args.func
    code = run_guarded("mlxppd", _on_fast_blas(lambda: int(func(args))))
    if args.command in ("serve", "agent"):
        serve_command.exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
