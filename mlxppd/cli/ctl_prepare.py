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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from mlxppd.cli.ctl_status import read_status
from mlxppd.cli.ctl_target import Target, call
from mlxppd.core.partition.sizes import parse_byte_size
from mlxppd.core.status_document import PrepareNodeProgress
from mlxppd.http.admin_models import PREPARE_PATH

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
        job = read_status(target, args.timeout).coordinator.prepare
        nodes = job.nodes if job is not None else ()
        view.show(nodes)
        if job is not None and job.state in ("done", "failed"):
            view.finish(nodes)
            return EXIT_OK if job.state == "done" else EXIT_FAILED
        time.sleep(0.5)
    print(f"mlxppctl: still preparing after {args.wait_timeout:g} s", file=sys.stderr)
    return EXIT_FAILED


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "--"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _done(node: PrepareNodeProgress) -> int:
    """Bytes the node holds of those it lacked: resumed plus sent."""
    return node.bytes_resumed + node.bytes_sent


def progress_line(node: PrepareNodeProgress, bar_width: int = 24) -> str:
    """One node's progress: bar, share, MB done of MB needed, rate, ETA, state."""
    total, done = node.bytes_total, _done(node)
    share = done / total if total else (1.0 if node.state == "done" else 0.0)
    filled = round(share * bar_width)
    bar = "#" * filled + "." * (bar_width - filled)
    state = node.state or "waiting"
    if node.found:
        state += f" ({node.found})"
    if node.error:
        state += f": {node.error}"
    extra = f", {node.bytes_resumed / MB:.1f} MB resumed" if node.bytes_resumed else ""
    return (
        f"{node.node!s:<16} [{bar}] {share:4.0%}  {done / MB:8.1f} / {total / MB:.1f} MB"
        f"{extra}  {node.rate_bytes_s / MB:6.1f} MB/s  ETA {_duration(node.eta_s)}  {state}"
    )


class ProgressView:
    """Bars redrawn in place on a terminal; plain lines when they matter otherwise."""

    def __init__(self, out: TextIO, tty: bool) -> None:
        self.out, self.tty = out, tty
        self._drawn = 0
        self._last: dict[str, tuple[str, int]] = {}

    def show(self, nodes: Sequence[PrepareNodeProgress]) -> None:
        if self.tty:
            if self._drawn:
                self.out.write(f"\x1b[{self._drawn}F")  # back to the first bar
            for node in nodes:
                self.out.write("\x1b[2K" + progress_line(node) + "\n")
            self._drawn = len(nodes)
        else:
            for node in nodes:
                total = node.bytes_total
                key = (node.state, (10 * _done(node) // total) if total else 0)
                if self._last.get(node.node) != key:
                    self._last[node.node] = key
                    self.out.write(progress_line(node) + "\n")
        self.out.flush()

    def finish(self, nodes: Sequence[PrepareNodeProgress]) -> None:
        for node in nodes:
            if node.state == "done":
                self.out.write(
                    f"{node.node}: holds the cluster's copy of layers {list(node.layers)} "
                    f"({node.found or 'checked'}); {node.bytes_sent / MB:.1f} MB sent of the "
                    f"stage's {node.stage_bytes / MB:.1f} MB\n"
                )
            else:
                self.out.write(f"{node.node}: FAILED: {node.error}\n")
        self.out.flush()
