"""``mlxppctl status|drain|resume``: the coordinator's admin API, from the command line.

Requests are signed with an operator key (``--operator-key``), or in legacy mode with a key
derived from the cluster secret, for the cluster's name and the coordinator's address
(docs/admin-api.md); ``mlxppd.cli.ctl_target`` finds them and sends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from pydantic import MISSING

from mlxppd.cli import ctl_adapter, ctl_prepare
from mlxppd.cli.ctl_prepare import progress_line
from mlxppd.cli.ctl_status import read_events, read_status
from mlxppd.cli.ctl_target import CoordinatorUnreachable, Target, call
from mlxppd.cli.tls_client import add_tls_flags
from mlxppd.core.agent.elastic import ElasticState, Outcome
from mlxppd.core.agent.health import UNHEALTHY
from mlxppd.core.config.private_file import ALLOW_LOOSE_FLAG, ENV_ALLOW_LOOSE
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.partition.sizes import parse_byte_size
from mlxppd.core.status_document import (
    CoordinatorStatus,
    IdentityStatus,
    RepartitionEventRecord,
    SlotStatus,
    StageCard,
    StatusDocument,
)
from mlxppd.http.admin_models import DRAIN_PATH, REPARTITION_PATH, RESUME_PATH

__all__ = ["CoordinatorUnreachable", "register", "render_status"]

DEFAULT_TIMEOUT_S = 10.0
MiB = 1024 * 1024

EXIT_OK = 0
EXIT_UNHEALTHY = 1

_EXAMPLES = """\
examples:
  mlxppctl {name}                                  # address and secret from /etc/mlxpp
  mlxppctl {name} --config-dir ./etc/mlxpp --operator-key ~/.mlxpp/operator.key
  mlxppctl {name} --url http://10.0.0.1:8080 --cluster-secret-file ~/cluster.secret
"""

_TARGET_HELP = """\
The coordinator's address is --url, else http_host/http_port from mlxppd.toml in the config
directory (0.0.0.0 and :: mean this host). Requests are signed with --operator-key (or
MLXPP_OPERATOR_KEY_FILE), a key from `mlxppctl operator-key new` listed under [operators] in
the cluster TOML; a cluster that lists [operators] accepts nothing else. Without one (legacy
mode) they are signed with a key derived from the cluster secret, looked up as everywhere else:
--cluster-secret-file, MLXPP_CLUSTER_SECRET_FILE, MLXPP_CLUSTER_SECRET, then secret_file in
mlxppd.toml or [cluster] secret_file in cluster.toml. The signature covers the cluster's name
(--cluster-name, else [cluster] name in the config directory's cluster.toml, else what the
coordinator says) and the coordinator's address; a redirect is reported, never followed. Only
a signature derived from the secret is sent, never the secret. An https:// coordinator (https
also when mlxppd.toml sets tls_cert_file) is verified by the system's trust store, or by
--cacert FILE, or accepted by its certificate's fingerprint alone with --pin-sha256."""


def register(subparsers: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    target = common.add_argument_group("coordinator and secret")
    target.add_argument(
        "--url",
        metavar="URL",
        help="the coordinator's base URL, e.g. http://10.0.0.1:8080 or https://... (default: "
        "from the config directory's mlxppd.toml)",
    )
    target.add_argument(
        "--config-dir",
        metavar="DIR",
        help="config directory with mlxppd.toml and cluster.toml (default: $MLXPP_CONFIG_DIR, "
        "else /etc/mlxpp)",
    )
    target.add_argument(
        "--operator-key",
        metavar="PATH",
        help="operator key file to sign with (`mlxppctl operator-key new`); default "
        "$MLXPP_OPERATOR_KEY_FILE, else the cluster secret signs (legacy mode)",
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
    add_tls_flags(target)
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
    document = read_status(Target(args, environ), args.timeout)
    if args.json:
        print(json.dumps(document.model_dump(mode="json"), indent=2))
    else:
        print(render_status(document, dash=_dash()))
    return EXIT_UNHEALTHY if document.health == UNHEALTHY else EXIT_OK


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
    state = ElasticState.DRAINING
    while time.monotonic() < deadline:
        page = read_events(target, after, args.timeout)
        state = page.state
        for event in page.events:
            after = max(after, after if event.seq is MISSING else event.seq)
            print(_event_line(event), flush=True)
            if event.to in (ElasticState.IDLE, ElasticState.FAILED):
                return EXIT_OK if event.outcome == Outcome.COMPLETED else EXIT_UNHEALTHY
        time.sleep(0.5)
    print(f"mlxppctl: still {state} after {args.wait_timeout:g} s", file=sys.stderr)
    return EXIT_UNHEALTHY


def _event_line(event: RepartitionEventRecord) -> str:
    line = f"{event.from_} -> {event.to} ({event.outcome}) after {event.phase_s:.2f} s"
    if event.to == ElasticState.RESUMING:
        line += f"; new layers {event.ranges_after}"
    if event.to in (ElasticState.IDLE, ElasticState.FAILED):
        line += f"; total {event.total_s:.2f} s"
        line += f"; layers in force {event.ranges_after or event.ranges_before}"
    if event.detail:
        line += f": {event.detail}"
    return line


# --- text rendering ---


def _dash() -> str:
    # An em dash where the terminal can show one.
    try:
        "\u2014".encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return "-"
    return "\u2014"


def _text(value: object, none: str = "unknown") -> str:
    return none if value is None or value == "" else str(value)


def _yes_no(value: bool | None, yes: str, no: str) -> str:
    return "unknown" if value is None else (yes if value else no)


def _identity(identity: IdentityStatus | None) -> str:
    if identity is None:
        return "not checked"
    state = _text(identity.state)
    if identity.detail and state != "verified":
        return f"{state}: {identity.detail}"
    digest = identity.actual_sha256
    return f"{state} (sha256 {digest[:16]})" if digest else state


def _kv(used: int | None, budget: int | None) -> str:
    if used is None:
        return "unknown"
    if budget is None or budget <= 0:
        return f"{used / MiB:.1f} MiB used, no budget"
    return f"{used / MiB:.1f} / {budget / MiB:.1f} MiB ({used / budget:.0%})"


def _stage_card(stage: StageCard) -> list[str]:
    """One stage's card: a heading, then one aligned row per fact."""
    rows = (
        ("layers", _text(stage.layers)),
        ("process", _yes_no(stage.process_alive, "alive", "NOT RUNNING")),
        ("transport", _yes_no(stage.transport_connected, "connected", "NOT CONNECTED")),
        ("in flight", _text(stage.in_flight)),
        ("KV cache", _kv(stage.kv_used_bytes, stage.kv_budget_bytes)),
        ("weights", _text(stage.weights)),
        ("BLAS", _text(stage.blas)),
        ("elastic state", _text(stage.elastic_state)),
        ("config generation", _text(stage.config_generation)),
        ("last reload error", _text(stage.last_reload_error, none="none")),
        ("model identity", _identity(stage.identity)),
    )
    slots = stage.slots
    rank = "  rank 0" if slots else ""
    heading = f"stage {_text(stage.stage)}{rank}  {_text(stage.node_id)}  {_text(stage.address)}"
    card = [heading, *(f"  {name:<18} {value}" for name, value in rows)]
    if slots:
        card.append(f"  {'weights held':<18} {_mb(slots[0].parameter_bytes)}")
    for slot in slots[1:]:
        card += _slot_card(stage, slot)
    return card


def _mb(value: int | None) -> str:
    return f"{value / 1e6:.1f} MB" if value is not None else "unknown"


def _slot_card(stage: StageCard, slot: SlotStatus) -> list[str]:
    """A tensor-parallel rank above 0: it runs every pass rank 0 runs, on its own shard."""
    rows = (
        ("layers", f"{_text(stage.layers)} (its shard)"),
        ("process", _yes_no(stage.process_alive, "alive (follows rank 0)", "NOT RUNNING")),
        ("in flight", _text(stage.in_flight)),
        ("KV cache", _kv(slot.kv_used_bytes, slot.kv_budget_bytes)),
        ("weights held", _mb(slot.parameter_bytes)),
    )
    heading = f"stage {_text(stage.stage)}  rank {slot.rank}  {_text(slot.node_id)}"
    return ["", heading, *(f"  {name:<18} {value}" for name, value in rows)]


def _coordinator_line(c: CoordinatorStatus) -> str:
    return (
        f"coordinator {_text(c.node_id)} (http {_text(c.http_address)}): admission "
        f"{c.admission}, {c.in_flight} in flight, {c.waiting} waiting, config generation "
        f"{_text(c.config_generation)}, last reload "
        + (f"failed: {c.last_reload_error}" if c.last_reload_error else "ok")
    )


def _history(c: CoordinatorStatus) -> list[str]:
    """Elastic repartitioning, the failovers and the last prepare, when there are any."""
    lines = []
    if c.elastic_enabled is not MISSING:
        elastic = "elastic repartitioning: " + (
            str(c.elastic_state) if c.elastic_enabled else "off"
        )
        event = c.last_repartition_event
        if event is not MISSING and event is not None:
            elastic += f"; last event: {_event_line(event)} ({event.trigger})"
        lines.append(elastic)
    if c.failovers:
        last = c.failovers[-1]
        lines.append(
            f"failovers: {len(c.failovers)}; last: stage {last.lost_stage} ({last.lost_node}) "
            f"lost, {_text(last.outcome)} after {last.seconds:.1f} s: {_text(last.detail)}; "
            f"{last.sequences} sequences"
        )
    if c.prepare is not None:
        lines.append(f"prepare ({_text(c.prepare.reason)}): {c.prepare.state}")
        lines += [f"  {progress_line(n)}" for n in c.prepare.nodes]
    return lines


def render_status(document: StatusDocument, *, dash: str) -> str:
    """The human-readable status: a badge line, the coordinator line, one card per stage."""
    coordinator = document.coordinator
    lines = [
        f"cluster {_text(document.cluster)}: {document.health.upper()} {dash} {document.detail}",
        _coordinator_line(coordinator),
        *(f"warning: {_text(w)}" for w in coordinator.warnings),
        *_history(coordinator),
    ]
    if document.standbys:
        names = []
        for standby in document.standbys:
            serving = standby.layers and f"serving stage {_text(standby.stage)}"
            names.append(f"{_text(standby.node_id)} ({serving or 'idle'})")
        lines.append("standby nodes: " + ", ".join(names))
    for stage in document.stages:
        lines += ["", *_stage_card(stage)]
    return "\n".join(lines)
