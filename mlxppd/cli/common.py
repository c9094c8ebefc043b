"""What every mlxpp command shares: one-line errors and their exit codes."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from mlxppd.core.errors import MlxppError


def _flag(loc: tuple[int | str, ...]) -> str:
    return "--" + "-".join(str(p) for p in loc).replace("_", "-") if loc else "input"


def run_guarded(prog: str, body: Callable[[], int]) -> int:
    """Run a command body; expected errors become one line on stderr and an exit code."""
    try:
        return body()
    except MlxppError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ValidationError as exc:
        first = exc.errors()[0]
        print(f"{prog}: error: {_flag(first['loc'])}: {first['msg']}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`mlxppctl status | head`): nothing left to say to it.
        # Point stdout at /dev/null so the flush at exit does not fail a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def cpu_weights_flag(p: argparse.ArgumentParser, default: str | None = "auto") -> None:
    """``--cpu-weights``, parsed into ``CpuWeights`` (None when ``default`` is None)."""
    from mlxppd.core.cpu_weights import CpuWeights

    p.add_argument(
        "--cpu-weights",
        type=CpuWeights,
        choices=list(CpuWeights),
        default=CpuWeights(default) if default is not None else None,
        metavar="{auto,native,float32}",
        help="weights on a CPU host: float32 materializes a quantized checkpoint in float32 "
        "at load (each stage only its own layers; 8x the memory of 4-bit, prefill ~30x faster "
        "on an optimized BLAS); native keeps the checkpoint's; auto (default) picks float32 "
        "on a CPU host with an optimized BLAS when it fits in memory",
    )


def command_group(subparsers: Any, name: str, *, help: str, description: str, dest: str) -> Any:
    """A command of actions (``mlxppctl secret new``): alone, it prints its usage and exits 2;
    returns the subparsers its actions are added to."""
    parser = subparsers.add_parser(name, help=help, description=description)

    def usage(_args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    parser.set_defaults(func=usage)
    return parser.add_subparsers(dest=dest, metavar="ACTION")
