"""``mlxppctl operator-key new PATH [--name NAME]``: write an operator's Ed25519 key (mode 0600)
and print the ``[operators]`` line that lets it sign admin requests. ``mlxppctl operator-key
public PATH``: print that line again."""

from __future__ import annotations

import argparse
import getpass
import sys
from pathlib import Path
from typing import Any

from mlxppd.cli.common import command_group
from mlxppd.core.config.names import name_problem
from mlxppd.core.config.private_file import ALLOW_LOOSE_FLAG
from mlxppd.core.errors import ConfigurationError
from mlxppd.wire.operator_key import (
    OPERATOR_KEY_FLAG,
    OPERATORS_KEY,
    load_operator_key,
    write_new_operator_key,
)

__all__ = ["register"]


def register(subparsers: Any) -> None:
    sub = command_group(
        subparsers,
        "operator-key",
        help="manage an operator's admin signing key",
        description="An operator key signs admin requests (drain, resume, repartition, "
        f"adapters, prepare). Once the cluster TOML lists {OPERATORS_KEY}, only those keys "
        "sign: the cluster secret, which every stage host holds, no longer does. Make the key "
        "on the operator's own machine; it never goes to a cluster host.",
        dest="operator_key_command",
    )
    new = sub.add_parser(
        "new",
        help="write a fresh operator key and print its [operators] line",
        description="Write a fresh Ed25519 private key to PATH (mode 0600; one line NAME:BASE64, "
        "which the web console's admin key field also takes) and print the line to add under "
        f"{OPERATORS_KEY} in the cluster TOML. Sign with it: mlxppctl drain {OPERATOR_KEY_FLAG} "
        "PATH.",
    )
    new.add_argument("path", metavar="PATH", type=Path, help="where to write the key")
    new.add_argument(
        "--name", help="the operator's name in [operators] (default: this user's login name)"
    )
    new.add_argument("--force", action="store_true", help="replace PATH if it exists (atomically)")
    new.set_defaults(func=_new)
    public = sub.add_parser(
        "public",
        help="print the [operators] line of an existing key",
        description=f"Print the {OPERATORS_KEY} line (name = public key) of the key in PATH.",
    )
    public.add_argument("path", metavar="PATH", type=Path, help="the operator key file")
    public.add_argument(
        ALLOW_LOOSE_FLAG, action="store_true",
        help="accept a key file other users can read (see docs/operations.md, section 4)",
    )  # fmt: skip
    public.set_defaults(func=_public)


def _name(given: str | None) -> str:
    name = given if given is not None else getpass.getuser()
    problem = name_problem(name, "the operator name")
    if problem is not None:
        raise ConfigurationError(f"{problem}; pass --name NAME", source="--name")
    return name


def _new(args: argparse.Namespace) -> int:
    key = write_new_operator_key(args.path, _name(args.name), force=args.force)
    # The private half is never printed; the public one is what the cluster TOML needs.
    print(key.operators_line)
    print(
        f"wrote a new operator key to {args.path} (mode 0600); add the line above under "
        f"{OPERATORS_KEY} in the cluster TOML, then sign with {OPERATOR_KEY_FLAG} {args.path}",
        file=sys.stderr,
    )
    return 0


def _public(args: argparse.Namespace) -> int:
    key = load_operator_key(
        args.path, named_by="PATH", allow_loose=args.allow_loose_secret_file or None
    )
    print(key.operators_line)
    return 0
