"""``mlxppctl secret new PATH``: write a fresh cluster secret (mode 0600)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mlxppd.wire.secret import write_new_secret


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "secret",
        help="manage the cluster secret",
        description="Manage the pre-shared cluster secret every pipeline role needs.",
    )
    parser.set_defaults(func=lambda _args: _usage(parser))
    sub = parser.add_subparsers(dest="secret_command", metavar="ACTION")
    new = sub.add_parser(
        "new",
        help="write a fresh secret file",
        description="Write 32 random bytes, hex-encoded, to PATH with mode 0600. Copy the file "
        "to every host and point --cluster-secret-file (or [cluster] secret_file) at it.",
    )
    new.add_argument("path", metavar="PATH", type=Path, help="where to write the secret")
    new.add_argument("--force", action="store_true", help="replace PATH if it exists (atomically)")
    new.set_defaults(func=_new)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _new(args: argparse.Namespace) -> int:
    write_new_secret(args.path, force=args.force)
    # The secret itself is never printed: it would end up in terminal scrollback and logs.
    print(
        f"wrote a new cluster secret to {args.path} (mode 0600); copy it to every host",
        file=sys.stderr,
    )
    return 0
