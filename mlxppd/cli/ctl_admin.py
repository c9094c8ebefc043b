"""``mlxppctl status|drain|resume``: the coordinator's admin API, from the command line.

Requests are signed with a key derived from the cluster secret, for the cluster's name and the
coordinator's address (docs/admin-api.md); ``mlxppd.cli.ctl_target`` finds them and sends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from mlxppd.cli import ctl_adapter, ctl_prepare
from mlxppd.cli.ctl_prepare import progress_line
from mlxppd.cli.ctl_target import CoordinatorUnreachable, Target, call
from mlxppd.core.agent.health import UNHEALTHY, overall_health
from mlxppd.core.config.private_file import ALLOW_LOOSE_FLAG, ENV_ALLOW_LOOSE
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.partition.sizes import parse_byte_size
from mlxppd.http.admin_api import (
    DRAIN_PATH,
    EVENTS_PATH,
    REPARTITION_PATH,
    RESUME_PATH,
    STATUS_PATH,
)

__all__ = ["CoordinatorUnreachable", "register", "render_status"]

DEFAULT_TIMEOUT_S = 10.0
MiB = 1024 * 1024

EXIT_OK = 0
EXIT_UNHEALTHY = 1

_EXAMPLES = """\
examples:
  mlxppctl {name}                                  # address and secret from /etc/mlxpp
  mlxppctl {name} --config-dir ./etc/mlxpp
  mlxppctl {name} --url http://10.0.0.1:8080 --cluster-secret-file ~/cluster.secret
"""

_TARGET_HELP = """\
The coordinator's address is --url, else http_host/http_port from mlxppd.toml in the config
directory (0.0.0.0 and :: mean this host). The cluster secret is looked up as everywhere else:
--cluster-secret-file, MLXPP_CLUSTER_SECRET_FILE, MLXPP_CLUSTER_SECRET, then secret_file in
mlxppd.toml or [cluster] secret_file in cluster.toml. The signature covers the cluster's name
(--cluster-name, else [cluster] name in the config directory's cluster.toml, else what the
coordinator says) and the coordinator's address; a redirect is reported, never followed. Only
a signature derived from the secret is sent, never the secret."""


def register(subparsers: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    target = common.add_argument_group("coordinator and secret")
    target.add_argument(
        "--url",
        metavar="URL",
        help="the coordinator's base URL, e.g. http://10.0.0.1:8080 (default: from the config "
        "directory's mlxppd.toml)",
    )
    target.add_argument(
        "--config-dir",
        metavar="DIR",
        help="config directory with mlxppd.toml and cluster.toml (default: $MLXPP_CONFIG_DIR, "
        "else /etc/mlxpp)",
    )
    target.add_argument(
        "--cluster-secret-file", metavar="PATH", help="file holding the cluster secret"
    )
    target.add_argument(
        "--cluster-name",
        metavar="NAME",
        help="the [cluster] name the request is signed for (default: the config directory's "
        "cluster.toml, else what the coordinator says)",
    )
    target.add_argument(
        ALLOW_LOOSE_FLAG,
        action="store_true",
        help=f"use a secret file that fails the permission rule, with a warning (as "
        f"{ENV_ALLOW_LOOSE}=1)",
    )
    target.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"give up on the coordinator after this long (default {DEFAULT_TIMEOUT_S:g})",
    )

    def add(name: str, help: str, description: str, extra: str = "") -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = subparsers.add_parser(
            name,
            parents=[common],
            help=help,
            description=f"{description}\n\n{_TARGET_HELP}",
            epilog=_EXAMPLES.format(name=name) + extra,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        return parser

    status = add(
        "status",
        "show the cluster's health, the coordinator and every stage",
        "Ask the coordinator for the cluster's status: a health badge (healthy, degraded or\n"
        "unhealthy) with the reason, the coordinator's admission state and one card per\n"
        "pipeline stage.",
        "\nexit status: 0 healthy or degraded, 1 unhealthy, 2 bad configuration or arguments,\n"
        "3 the coordinator cannot be reached or refused the signature\n",
    )
    status.add_argument(
        "--json", action="store_true", help="print the status document as received (JSON)"
    )
    status.set_defaults(func=lambda args: _status(args, os.environ))

    drain = add(
        "drain",
        "stop admitting new requests; running ones finish",
        "Stop the coordinator admitting new requests (they get HTTP 503 with Retry-After)\n"
        "while the ones in flight finish. Use it before maintenance; `mlxppctl resume`\n"
        "undoes it.",
    )
    drain.set_defaults(func=lambda args: _admission(args, os.environ, DRAIN_PATH))

    resume = add(
        "resume",
        "admit new requests again after a drain",
        "Let the coordinator admit new requests again after `mlxppctl drain`.",
    )
    resume.set_defaults(func=lambda args: _admission(args, os.environ, RESUME_PATH))

    repartition = add(
        "repartition",
        "move layers between stages on the live cluster (elastic)",
        "Send an explicit elastic repartition trigger: the coordinator drains (new requests\n"
        "get 503 with Retry-After, running ones finish), plans new layer ranges with the\n"
        "partitioner over each stage's memory budget (or takes --pp-layers), has every stage\n"
        "load only the layers it gains, and resumes. Any failure keeps the old ranges.\n"
        "Needs [cluster.elastic] enabled = true (or --enable-elastic-pp on the coordinator).",
        "\nexit status: 0 accepted (with --wait: completed), 1 refused or failed,\n"
        "2 bad arguments, 3 the coordinator cannot be reached\n",
    )
    repartition.add_argument(
        "--stage-memory",
        metavar="SIZES",
        help="memory budget per stage, e.g. 8GiB,4GiB (- for unlimited); default: what each "
        "stage's node reports",
    )
    repartition.add_argument(
        "--pp-layers", metavar="RANGES", help='the new inclusive ranges, e.g. "0-9,10-29"'
    )
    repartition.add_argument(
        "--wait", action="store_true", help="print each transition until the repartition ends"
    )
    repartition.add_argument(
        "--wait-timeout",
        metavar="SECONDS",
        type=float,
        default=900.0,
        help="give up waiting after this long (default 900)",
    )
    repartition.set_defaults(func=lambda args: _repartition(args, os.environ))
    ctl_prepare.register(add)
    ctl_adapter.register(add)


# --- the subcommands ---


def _status(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    target = Target(args, environ)
    document = call(target, "GET", STATUS_PATH, args.timeout)
    badge = document.get("health")
    detail = document.get("detail")
    if not isinstance(badge, str) or not isinstance(detail, str):
        badge, detail = overall_health(document)
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(render_status(document, badge, detail, dash=_dash()))
    return EXIT_UNHEALTHY if badge == UNHEALTHY else EXIT_OK


def _admission(args: argparse.Namespace, environ: Mapping[str, str], path: str) -> int:
    target = Target(args, environ)
    reply = call(target, "POST", path, args.timeout)
    line = f"admission {reply.get('admission', 'unknown')}"
    in_flight = reply.get("in_flight")
    if isinstance(in_flight, int):
        line += f": {in_flight} request{'' if in_flight == 1 else 's'} in flight"
    print(line)
    return EXIT_OK


def _stage_memory(text: str) -> list[int | None]:
    sizes: list[int | None] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ConfigurationError(
                f"{text!r} has an empty entry; give one size per stage, like 8GiB,4GiB",
                source="--stage-memory",
            )
        sizes.append(None if part == "-" else parse_byte_size(part, source="--stage-memory"))
    return sizes


def _repartition(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    request: dict[str, Any] = {}
    if args.stage_memory:
        request["stage_memory"] = _stage_memory(args.stage_memory)
    if args.pp_layers:
        request["pp_layers"] = args.pp_layers
    target = Target(args, environ)
    body = json.dumps(request).encode()
    reply = call(target, "POST", REPARTITION_PATH, args.timeout, body=body, accept=(409,))
    if not reply.get("accepted"):
        print(
            f"mlxppctl: repartition refused ({reply.get('reason')}): {reply.get('message')}",
            file=sys.stderr,
        )
        return EXIT_UNHEALTHY
    seq = int(reply.get("seq", -1))
    print(f"repartition accepted: {reply.get('state', 'draining')}")
    if not args.wait:
        return EXIT_OK
    deadline = time.monotonic() + args.wait_timeout
    after = seq - 1
    while time.monotonic() < deadline:
        page = call(target, "GET", f"{EVENTS_PATH}?after={after}", args.timeout)
        for event in page.get("events", []):
            after = max(after, int(event.get("seq", after)))
            print(_event_line(event), flush=True)
            if event.get("to") in ("idle", "failed"):
                return EXIT_OK if event.get("outcome") == "completed" else EXIT_UNHEALTHY
        time.sleep(0.5)
    print(f"mlxppctl: still {page.get('state')} after {args.wait_timeout:g} s", file=sys.stderr)
    return EXIT_UNHEALTHY


def _event_line(event: Mapping[str, Any]) -> str:
    line = (
        f"{event.get('from')} -> {event.get('to')} ({event.get('outcome')}) "
        f"after {float(event.get('phase_s') or 0):.2f} s"
    )
    if event.get("to") == "resuming":
        line += f"; new layers {event.get('ranges_after')}"
    if event.get("to") in ("idle", "failed"):
        line += f"; total {float(event.get('total_s') or 0):.2f} s"
        line += f"; layers in force {event.get('ranges_after') or event.get('ranges_before')}"
    if event.get("detail"):
        line += f": {event.get('detail')}"
    return line


# --- text rendering ---


def _dash() -> str:
    # An em dash where the terminal can show one.
    try:
        "\u2014".encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return "-"
    return "\u2014"


def _text(value: Any, none: str = "unknown") -> str:
    return none if value is None or value == "" else str(value)


def _yes_no(value: Any, yes: str, no: str) -> str:
    return "unknown" if value is None else (yes if value else no)


def _identity(identity: Any) -> str:
    if not isinstance(identity, Mapping):
        return "not checked"
    state = _text(identity.get("state"))
    if identity.get("detail") and state != "verified":
        return f"{state}: {identity['detail']}"
    digest = identity.get("actual_sha256")
    return f"{state} (sha256 {str(digest)[:16]})" if digest else state


def _kv(used: Any, budget: Any) -> str:
    if not isinstance(used, int):
        return "unknown"
    if not isinstance(budget, int) or budget <= 0:
        return f"{used / MiB:.1f} MiB used, no budget"
    return f"{used / MiB:.1f} / {budget / MiB:.1f} MiB ({used / budget:.0%})"


def _stage_card(stage: Mapping[str, Any]) -> list[str]:
    """One stage's card: a heading, then one aligned row per fact."""
    rows = (
        ("layers", _text(stage.get("layers"))),
        ("process", _yes_no(stage.get("process_alive"), "alive", "NOT RUNNING")),
        ("transport", _yes_no(stage.get("transport_connected"), "connected", "NOT CONNECTED")),
        ("in flight", _text(stage.get("in_flight"))),
        ("KV cache", _kv(stage.get("kv_used_bytes"), stage.get("kv_budget_bytes"))),
        ("weights", _text(stage.get("weights"))),
        ("BLAS", _text(stage.get("blas"))),
        ("elastic state", _text(stage.get("elastic_state"))),
        ("config generation", _text(stage.get("config_generation"))),
        ("last reload error", _text(stage.get("last_reload_error"), none="none")),
        ("model identity", _identity(stage.get("identity"))),
    )
    slots = [s for s in stage.get("slots") or () if isinstance(s, Mapping)]
    rank = "  rank 0" if slots else ""
    heading = (
        f"stage {_text(stage.get('stage'))}{rank}  {_text(stage.get('node_id'))}  "
        f"{_text(stage.get('address'))}"
    )
    card = [heading, *(f"  {name:<18} {value}" for name, value in rows)]
    if slots:
        card.append(f"  {'weights held':<18} {_mb(slots[0].get('parameter_bytes'))}")
    for slot in slots[1:]:
        card += _slot_card(stage, slot)
    return card


def _mb(value: Any) -> str:
    return f"{value / 1e6:.1f} MB" if isinstance(value, int) else "unknown"


def _slot_card(stage: Mapping[str, Any], slot: Mapping[str, Any]) -> list[str]:
    """A tensor-parallel rank above 0: it runs every pass rank 0 runs, on its own shard."""
    rows = (
        ("layers", f"{_text(stage.get('layers'))} (its shard)"),
        ("process", _yes_no(stage.get("process_alive"), "alive (follows rank 0)", "NOT RUNNING")),
        ("in flight", _text(stage.get("in_flight"))),
        ("KV cache", _kv(slot.get("kv_used_bytes"), slot.get("kv_budget_bytes"))),
        ("weights held", _mb(slot.get("parameter_bytes"))),
    )
    heading = f"stage {_text(stage.get('stage'))}  rank {_text(slot.get('rank'))}  " + _text(
        slot.get("node_id")
    )
    return ["", heading, *(f"  {name:<18} {value}" for name, value in rows)]


def render_status(document: Mapping[str, Any], badge: str, detail: str, *, dash: str) -> str:
    """The human-readable status: a badge line, the coordinator line, one card per stage."""
    raw = document.get("coordinator")
    coordinator: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    lines = [
        f"cluster {_text(document.get('cluster'))}: {badge.upper()} {dash} {detail}",
        "coordinator {node} (http {address}): admission {admission}, {flight} in flight, "
        "{waiting} waiting, config generation {gen}, last reload {reload}".format(
            node=_text(coordinator.get("node_id")),
            address=_text(coordinator.get("http_address")),
            admission=_text(coordinator.get("admission")),
            flight=_text(coordinator.get("in_flight")),
            waiting=_text(coordinator.get("waiting")),
            gen=_text(coordinator.get("config_generation")),
            reload=(
                f"failed: {coordinator['last_reload_error']}"
                if coordinator.get("last_reload_error")
                else "ok"
            ),
        ),
    ]
    warnings = coordinator.get("warnings")
    lines += [f"warning: {_text(w)}" for w in warnings] if isinstance(warnings, list) else []
    if "elastic_enabled" in coordinator:
        elastic = "elastic repartitioning: " + (
            f"{_text(coordinator.get('elastic_state'))}"
            if coordinator.get("elastic_enabled")
            else "off"
        )
        event = coordinator.get("last_repartition_event")
        if isinstance(event, Mapping):
            elastic += f"; last event: {_event_line(event)} ({event.get('trigger')})"
        lines.append(elastic)
    failovers = coordinator.get("failovers")
    if isinstance(failovers, list) and failovers:
        last = failovers[-1] if isinstance(failovers[-1], Mapping) else {}
        lines.append(
            f"failovers: {len(failovers)}; last: stage {_text(last.get('lost_stage'))} "
            f"({_text(last.get('lost_node'))}) lost, {_text(last.get('outcome'))} after "
            f"{float(last.get('seconds') or 0):.1f} s: {_text(last.get('detail'))}; "
            f"{_text(last.get('sequences'))} sequences"
        )
    prepare = coordinator.get("prepare")
    if isinstance(prepare, Mapping):
        lines.append(f"prepare ({_text(prepare.get('reason'))}): {_text(prepare.get('state'))}")
        nodes = prepare.get("nodes")
        lines += (
            [f"  {progress_line(n)}" for n in nodes if isinstance(n, Mapping)]
            if isinstance(nodes, list)
            else []
        )
    standbys = document.get("standbys")
    if isinstance(standbys, list) and standbys:
        names = []
        for standby in standbys:
            if isinstance(standby, Mapping):
                serving = standby.get("layers") and f"serving stage {_text(standby.get('stage'))}"
                names.append(f"{_text(standby.get('node_id'))} ({serving or 'idle'})")
        lines.append("standby nodes: " + ", ".join(names))
    stages = document.get("stages")
    for stage in stages if isinstance(stages, list) else []:
        if isinstance(stage, Mapping):
            lines += ["", *_stage_card(stage)]
    return "\n".join(lines)
