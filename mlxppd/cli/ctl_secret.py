"""``mlxppctl secret new PATH``: write a fresh cluster secret (mode 0600).
``mlxppctl secret admin-key PATH``: print the admin key derived from it (the web console's
admin credential in legacy mode, on a cluster without [operators])."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mlxppd.cli.common import command_group
from mlxppd.wire.admin_auth import admin_key
from mlxppd.wire.secret import load_cluster_secret, write_new_secret


def register(subparsers: Any) -> None:
    sub = command_group(
        subparsers,
        "secret",
        help="manage the cluster secret",
        description="Manage the pre-shared cluster secret every pipeline role needs.",
        dest="secret_command",
    )
    new = sub.add_parser(
        "new",
        help="write a fresh secret file",
        description="Write 32 random bytes, hex-encoded, to PATH with mode 0600. Copy the file "
        "to every host and point --cluster-secret-file (or [cluster] secret_file) at it.",
    )
    new.add_argument("path", metavar="PATH", type=Path, help="where to write the secret")
    new.add_argument("--force", action="store_true", help="replace PATH if it exists (atomically)")
    new.set_defaults(func=_new)
    key = sub.add_parser(
        "admin-key",
        help="print the admin key the web console signs actions with",
        description="Print the admin API key derived from the cluster secret in PATH (64 hex "
        "digits; HKDF-SHA256, as mlxppctl signs with). Paste it into the web console's admin "
        "key field to drain, resume or repartition from the page. It opens the admin API of "
        "this cluster and nothing else: not the secret, not the transport between nodes. "
        "Legacy mode only: a cluster whose TOML lists [operators] refuses it, and takes the "
        "line of an operator key file instead (mlxppctl operator-key new).",
    )
    key.add_argument("path", metavar="PATH", help="the cluster secret file")
    key.add_argument(
        "--allow-loose-secret-file", action="store_true",
        help="accept a secret file other users can read (see docs/operations.md, section 4)",
    )  # fmt: skip
    key.set_defaults(func=_admin_key)


def _new(args: argparse.Namespace) -> int:
    write_new_secret(args.path, force=args.force)
    # The secret itself is never printed: it would end up in terminal scrollback and logs.
    print(
        f"wrote a new cluster secret to {args.path} (mode 0600); copy it to every host",
        file=sys.stderr,
    )
    return 0


def _admin_key(args: argparse.Namespace) -> int:
    secret = load_cluster_secret(
        flag_path=args.path, allow_loose=args.allow_loose_secret_file or None
    )
    print(admin_key(secret.key_bytes()).hex())
    print(
        "that is the admin key of this cluster's coordinator: keep it like a password",
        file=sys.stderr,
    )
    return 0
