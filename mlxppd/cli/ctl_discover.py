"""``mlxppctl discover``: the nodes of a cluster advertising on this link (DNS-SD, ``_mlxpp._tcp``).

Only advertisements signed with the cluster secret are listed; the others are counted by
reason on standard error (and logged escaped). The secret and the cluster name come from the
flags, else from this host's config directory, as for every mlxppctl command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from mlxppd.core.config.cluster import load_cluster_config
from mlxppd.core.config.host import CLUSTER_FILE, config_dir_from
from mlxppd.core.errors import ConfigurationError

__all__ = ["register"]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "discover",
        help="list the cluster's nodes advertising on this link (DNS-SD)",
        description="Browse multicast DNS for _mlxpp._tcp and list the nodes whose "
        "advertisement is signed with the cluster secret: node id, addresses, port, free "
        "memory, accelerator, version. Others are ignored and counted. The same services show "
        "in `dns-sd -B _mlxpp._tcp` (macOS) and `avahi-browse _mlxpp._tcp` (Linux).",
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to listen (default 3)")
    parser.add_argument("--cluster-secret-file", help="the cluster secret (default: as mlxppd)")
    parser.add_argument("--cluster-name", help="default: [cluster] name in the cluster TOML")
    parser.add_argument("--config-dir", help="default: MLXPP_CONFIG_DIR, else /etc/mlxpp")
    parser.add_argument(
        "--interface",
        action="append",
        metavar="ADDRESS",
        help="listen on the interface with this address (repeatable; default: every one)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.set_defaults(func=_discover)


def _cluster_name(args: argparse.Namespace) -> str:
    if args.cluster_name:
        return str(args.cluster_name)
    cluster_file = config_dir_from(args.config_dir, os.environ) / CLUSTER_FILE
    if not cluster_file.exists():
        raise ConfigurationError(
            f"no cluster name: pass --cluster-name, or run where {cluster_file} exists"
        )
    return load_cluster_config(cluster_file).cluster.name


def _discover(args: argparse.Namespace) -> int:
    if not 0 < args.timeout <= 60:
        raise ConfigurationError("use a number of seconds from 0 to 60", source="--timeout")
    from mlxppd.runtime.system.dnssd import browse
    from mlxppd.wire.dnssd_advert import advert_key
    from mlxppd.wire.secret import load_cluster_secret

    name = _cluster_name(args)
    secret = load_cluster_secret(
        flag_path=args.cluster_secret_file,
        environ=os.environ,
        config_dir=config_dir_from(args.config_dir, os.environ),
    )
    result = browse(
        advert_key(secret.key_bytes()), name, timeout_s=args.timeout, interfaces=args.interface
    )
    if args.json:
        nodes = [
            {
                "node_id": f.advert.node_id, "addresses": list(f.addresses),
                "port": f.advert.port, "free_memory_bytes": f.advert.free_memory_bytes,
                "accelerator": f.advert.accelerator, "version": f.advert.version,
            }
            for f in result.found
        ]  # fmt: skip
        print(json.dumps({"cluster": name, "nodes": nodes, "ignored": dict(result.ignored)}))
    else:
        print(
            f"{'NODE':<20} {'PORT':>5} {'FREE MEMORY':>12} {'ACCEL':<6} {'VERSION':<10} ADDRESSES"
        )
        for f in result.found:
            a = f.advert
            memory = f"{a.free_memory_bytes / 2**30:.1f} GiB"
            print(
                f"{a.node_id:<20} {a.port:>5} {memory:>12} {a.accelerator:<6} {a.version:<10} "
                + ", ".join(f.addresses)
            )
    if result.ignored:
        counts = ", ".join(f"{n} {why}" for why, n in sorted(result.ignored.items()))
        print(f"ignored advertisements not signed for cluster {name!r}: {counts}", file=sys.stderr)
    if not result.found:
        print(f"no node of cluster {name!r} answered within {args.timeout:g} s", file=sys.stderr)
        return 1
    return 0
