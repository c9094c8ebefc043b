"""``mlxppctl node-key new PATH``: write this host's own node key (mode 0600) and print the
``[roster]`` line that names it. ``mlxppctl node-key public PATH``: print that line again."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mlxppd.cli.common import command_group
from mlxppd.core.config.names import name_problem
from mlxppd.core.config.roster import ROSTER_KEY, roster_line
from mlxppd.core.errors import ConfigurationError
from mlxppd.wire.node_key import load_node_key, write_new_node_key

__all__ = ["register"]


def register(subparsers: Any) -> None:
    sub = command_group(
        subparsers,
        "node-key",
        help="manage this host's node key",
        description="Each node proves its id with a key of its own: a host can only be the "
        f"node whose private key it holds. The cluster TOML's {ROSTER_KEY} lists every node id "
        "with its public key; removing a line revokes that node.",
        dest="node_key_command",
    )
    new = sub.add_parser(
        "new",
        help="write a fresh node key and print its roster line",
        description="Write a fresh X25519 private key to PATH (mode 0600; keep it on this host "
        f"only) and print the line to add under {ROSTER_KEY} in the cluster TOML on every host.",
    )
    new.add_argument("path", metavar="PATH", type=Path, help="where to write the key")
    new.add_argument("--force", action="store_true", help="replace PATH if it exists (atomically)")
    new.add_argument("--node-id", default="NODE_ID", help="the node id to print in the roster line")
    new.set_defaults(func=_new)
    public = sub.add_parser(
        "public",
        help="print the roster line of an existing key",
        description=f"Print the {ROSTER_KEY} line (node id = public key) of the key in PATH.",
    )
    public.add_argument("path", metavar="PATH", type=Path, help="the node key file")
    public.add_argument(
        "--node-id", default="NODE_ID", help="the node id to print in the roster line"
    )
    public.add_argument(
        "--allow-loose-secret-file", action="store_true",
        help="accept a key file other users can read (see docs/operations.md, section 4)",
    )  # fmt: skip
    public.set_defaults(func=_public)


def _check_id(node_id: str) -> None:
    problem = name_problem(node_id, "the node id")
    if node_id != "NODE_ID" and problem is not None:
        raise ConfigurationError(problem, source="--node-id")


def _new(args: argparse.Namespace) -> int:
    _check_id(args.node_id)
    key = write_new_node_key(args.path, force=args.force)
    # The private half is never printed; the public one is what every host's roster needs.
    print(roster_line(args.node_id, key.public_text))
    print(
        f"wrote a new node key to {args.path} (mode 0600); add the line above under "
        f"{ROSTER_KEY} in the cluster TOML of every host",
        file=sys.stderr,
    )
    return 0


def _public(args: argparse.Namespace) -> int:
    _check_id(args.node_id)
    key = load_node_key(
        args.node_id, flag_path=args.path, allow_loose=args.allow_loose_secret_file or None
    )
    print(roster_line(args.node_id, key.public_text))
    return 0
