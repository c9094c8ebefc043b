"""``mlxppctl adapter load|unload|list``: change the per-request adapters of a live cluster.

A load has every stage read its own layers' tensors of the adapter (from the same path on each
host) and report their digest, which must match the coordinator's copy; requests may choose it
by name as soon as the command returns. An unload drains that adapter's requests only (new
ones for it are refused meanwhile), then drops it on every stage; nothing restarts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import MISSING

from mlxppd.cli.ctl_status import read_status
from mlxppd.cli.ctl_target import Target, call
from mlxppd.core.status_document import AdapterStatus
from mlxppd.http.admin_models import ADAPTERS_PATH, ADAPTERS_UNLOAD_PATH

EXIT_OK, EXIT_FAILED = 0, 1


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    parser = add(
        "adapter",
        "load, unload or list the LoRA adapters requests choose by model name",
        "Change the cluster's per-request LoRA adapters without a restart. `load NAME DIR`:\n"
        "every stage reads its own layers' tensors of the adapter in DIR (the same path on\n"
        "every stage host) and the coordinator checks their digests against its copy; then\n"
        "requests whose model is NAME run it. `unload NAME`: new requests for NAME are\n"
        "refused, running ones finish, then every stage drops it. `list`: what is loaded.",
        "\nexit status: 0 done, 1 refused or failed, 2 bad arguments, 3 the coordinator\n"
        "cannot be reached\n",
    )
    parser.add_argument(
        "adapter_action", metavar="ACTION", choices=("load", "unload", "list"),
        help="load, unload or list",
    )  # fmt: skip
    parser.add_argument("name", metavar="NAME", nargs="?", help="what requests send as model")
    parser.add_argument(
        "path", metavar="DIR", nargs="?", help="load: the adapter directory on every stage host"
    )
    parser.add_argument(
        "--drain-timeout",
        metavar="SECONDS",
        type=float,
        default=60.0,
        help="unload: how long its running requests may take to finish (default 60)",
    )
    parser.set_defaults(func=lambda args: run_adapter(args, os.environ))


def run_adapter(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    wanted = {"load": 2, "unload": 1, "list": 0}[args.adapter_action]
    given = sum(1 for v in (args.name, args.path) if v is not None)
    if given != wanted:
        usage = {"load": "load NAME DIR", "unload": "unload NAME", "list": "list"}
        print(
            f"mlxppctl: error: use mlxppctl adapter {usage[args.adapter_action]}", file=sys.stderr
        )
        return 2
    target = Target(args, environ)
    if args.adapter_action == "list":
        adapters = read_status(target, args.timeout).coordinator.adapters
        if adapters is MISSING:  # a pipeline without an adapter registry holds none
            adapters = AdapterStatus(fused=None, named={})
        print(f"fused: {adapters.fused or 'none'}")
        for name, entry in adapters.named.items():
            print(f"{name}: {entry.path} ({entry.running} requests running)")
        return EXIT_OK
    if args.adapter_action == "load":
        request: dict[str, Any] = {"name": args.name, "path": str(Path(args.path).absolute())}
        path = ADAPTERS_PATH
    else:
        request = {"name": args.name, "drain_timeout_s": args.drain_timeout}
        path = ADAPTERS_UNLOAD_PATH
    reply = call(
        target, "POST", path, args.timeout + request.get("drain_timeout_s", 0.0),
        body=json.dumps(request).encode(), accept=(409,),
    )  # fmt: skip
    if not reply.get("accepted"):
        print(
            f"mlxppctl: adapter {args.adapter_action} refused ({reply.get('reason')}): "
            f"{reply.get('message')}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if args.adapter_action == "load":
        stages = reply.get("stages") or []
        read = ", ".join(f"{s.get('read')}/{s.get('stored')}" for s in stages)
        print(
            f"adapter {args.name} loaded on {len(stages)} stages (tensors read per stage: {read})"
        )
    else:
        print(f"adapter {args.name} unloaded")
    return EXIT_OK
