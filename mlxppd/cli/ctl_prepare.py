"""``mlxppctl prepare``: have the coordinator ship every stage node the tensors its layers need,
and show each node's progress until all are done.

The coordinator's agent does the work (``runtime/agent/prepare_job.py``); this command starts it
with a signed request and follows the status document: on a terminal, one progress bar per node
(bytes, rate, ETA) redrawn in place; otherwise one plain line per node whenever its state
changes or another tenth of its bytes arrived.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from mlxppd.cli.ctl_target import Target, call
from mlxppd.core.partition.sizes import parse_byte_size
from mlxppd.http.admin_api import PREPARE_PATH, STATUS_PATH

EXIT_OK, EXIT_FAILED = 0, 1
MB = 1e6


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    parser = add(
        "prepare",
        "ship every stage node the model tensors its layers need",
        "Have the coordinator compare every stage node's copy of the model with its own, tensor\n"
        "by tensor (SHA-256 of the stored bytes): each node is `present`, `missing` or\n"
        "`mismatch`. What a node lacks or holds otherwise is sent from the coordinator's copy\n"
        "over the cluster's encrypted transport, only the tensors of that node's layers, then\n"
        "verified and installed in the node's model cache; the node's stage restarts on it.\n"
        "An interrupted prepare resumes where it stopped when run again.",
        "\nexit status: 0 every node holds the cluster's copy, 1 a node failed or the prepare\n"
        "was refused, 2 bad arguments, 3 the coordinator cannot be reached\n",
    )
    parser.add_argument(
        "--max-rate",
        metavar="BYTES",
        help="send at most this much per second to each node, e.g. 50MB (default: no cap)",
    )
    parser.add_argument(
        "--node", action="append", metavar="ID", help="prepare only this node (repeatable)"
    )
    parser.add_argument(
        "--no-wait", action="store_true", help="start the prepare and return at once"
    )
    parser.add_argument(
        "--wait-timeout",
        metavar="SECONDS",
        type=float,
        default=86400.0,
        help="stop following after this long (the prepare goes on; default 86400)",
    )
    parser.set_defaults(func=lambda args: run_prepare(args, os.environ))


def run_prepare(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    request: dict[str, Any] = {"nodes": args.node}
    if args.max_rate:
        request["max_rate_bytes_s"] = parse_byte_size(args.max_rate, source="--max-rate")
    target = Target(args, environ)
    body = json.dumps(request).encode()
    reply = call(target, "POST", PREPARE_PATH, args.timeout, body=body, accept=(409,))
    if not reply.get("accepted"):
        print(
            f"mlxppctl: prepare refused ({reply.get('reason')}): {reply.get('message')}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    print(f"prepare started for {', '.join(reply.get('nodes') or [])}", flush=True)
    if args.no_wait:
        return EXIT_OK
    view = ProgressView(sys.stdout, sys.stdout.isatty())
    deadline = time.monotonic() + args.wait_timeout
    while time.monotonic() < deadline:
        document = call(target, "GET", STATUS_PATH, args.timeout)
        job = (document.get("coordinator") or {}).get("prepare") or {}
        view.show(job.get("nodes") or [])
        if job.get("state") in ("done", "failed"):
            view.finish(job.get("nodes") or [])
            return EXIT_OK if job.get("state") == "done" else EXIT_FAILED
        time.sleep(0.5)
    print(f"mlxppctl: still preparing after {args.wait_timeout:g} s", file=sys.stderr)
    return EXIT_FAILED


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "--"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def progress_line(node: Mapping[str, Any], bar_width: int = 24) -> str:
    """One node's progress: bar, share, MB done of MB needed, rate, ETA, state."""
    total = int(node.get("bytes_total") or 0)
    done = int(node.get("bytes_resumed") or 0) + int(node.get("bytes_sent") or 0)
    share = done / total if total else (1.0 if node.get("state") == "done" else 0.0)
    filled = round(share * bar_width)
    bar = "#" * filled + "." * (bar_width - filled)
    state = str(node.get("state") or "waiting")
    found = node.get("found")
    if found:
        state += f" ({found})"
    if node.get("error"):
        state += f": {node['error']}"
    resumed = int(node.get("bytes_resumed") or 0)
    extra = f", {resumed / MB:.1f} MB resumed" if resumed else ""
    return (
        f"{node.get('node')!s:<16} [{bar}] {share:4.0%}  {done / MB:8.1f} / {total / MB:.1f} MB"
        f"{extra}  {float(node.get('rate_bytes_s') or 0) / MB:6.1f} MB/s  "
        f"ETA {_duration(node.get('eta_s'))}  {state}"
    )


class ProgressView:
    """Bars redrawn in place on a terminal; plain lines when they matter otherwise."""

    def __init__(self, out: TextIO, tty: bool) -> None:
        self.out, self.tty = out, tty
        self._drawn = 0
        self._last: dict[str, tuple[str, int]] = {}

    def show(self, nodes: list[Mapping[str, Any]]) -> None:
        if self.tty:
            if self._drawn:
                self.out.write(f"\x1b[{self._drawn}F")  # back to the first bar
            for node in nodes:
                self.out.write("\x1b[2K" + progress_line(node) + "\n")
            self._drawn = len(nodes)
        else:
            for node in nodes:
                total = int(node.get("bytes_total") or 0)
                done = int(node.get("bytes_resumed") or 0) + int(node.get("bytes_sent") or 0)
                key = (str(node.get("state")), (10 * done // total) if total else 0)
                if self._last.get(str(node.get("node"))) != key:
                    self._last[str(node.get("node"))] = key
                    self.out.write(progress_line(node) + "\n")
        self.out.flush()

    def finish(self, nodes: list[Mapping[str, Any]]) -> None:
        for node in nodes:
            if node.get("state") == "done":
                sent = int(node.get("bytes_sent") or 0)
                whole = int(node.get("stage_bytes") or 0)
                self.out.write(
                    f"{node.get('node')}: holds the cluster's copy of layers "
                    f"{node.get('layers')} ({node.get('found') or 'checked'}); {sent / MB:.1f} MB "
                    f"sent of the stage's {whole / MB:.1f} MB\n"
                )
            else:
                self.out.write(f"{node.get('node')}: FAILED: {node.get('error')}\n")
        self.out.flush()
