"""``mlxppctl``: the operator's control tool (status, repartition and secrets come later)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mlxppd import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxppctl",
        description="Control a running mlxpp cluster. This build has no subcommands yet; "
        "status, repartition and secret management arrive with the agent and transport.",
    )
    parser.add_argument("--version", action="version", version=f"mlxppctl {__version__}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    build_parser().parse_args(argv)
    build_parser().print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
