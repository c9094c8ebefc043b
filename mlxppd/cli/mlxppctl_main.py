"""``mlxppctl``: the operator's control tool.

Each subcommand lives in its own module under ``mlxppd.cli`` exposing
``register(subparsers) -> None``; the parser it adds sets ``func(args) -> int`` as its default.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from mlxppd import __version__
from mlxppd.cli.common import run_guarded

# Subcommand modules, in the order --help lists them.
_SUBCOMMANDS: tuple[str, ...] = (
    "ctl_admin",
    "ctl_plan",
    "ctl_secret",
    "ctl_node_key",
    "ctl_operator_key",
    "ctl_tls",
    "ctl_discover",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxppctl",
        description="Control and plan an mlxpp cluster.",
    )
    parser.add_argument("--version", action="version", version=f"mlxppctl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMANDS:
        importlib.import_module(f"mlxppd.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    return run_guarded("mlxppctl", lambda: int(func(args)))


if __name__ == "__main__":
    sys.exit(main())
