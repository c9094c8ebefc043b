"""``mlxppd serve``'s modes and the one table of the flags each mode uses.

No flag is accepted and ignored: right after parsing, ``check_serve_flags`` finds the mode from
the mode-selecting flags and refuses, with one sentence naming the flag and the mode, every
flag given that the mode does not use (``FLAGS_USED``), and every flag whose companion is
missing (``NEEDS``). A flag counts as given when its value is not None or False, so the parser
leaves every default None and ``with_defaults`` fills them in after the check
(``SERVE_DEFAULTS``). tests/cli/test_serve_flags.py walks every mode and every flag of the parser.
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlxppd.core.config.cluster import NodeRole, load_cluster_config
from mlxppd.core.config.names import name_problem
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.fair_share import DEFAULT_MAX_CHOICES_PER_REQUEST

__all__ = [
    "FLAGS_USED",
    "NEEDS",
    "SELECTORS",
    "SERVE_DEFAULTS",
    "Mode",
    "check_serve_flags",
    "flag_of",
    "given_flags",
    "serve_mode",
    "with_defaults",
]


class Mode(enum.Enum):
    """A serve mode; the value is how an error names it."""

    IN_PROCESS = "serving every stage in this process (no --pp-size or --distributed-config)"
    LOCAL_CLUSTER = "a local cluster (--pp-size/--pp-layers)"
    STAGE = "a pipeline stage node of --distributed-config"
    COORDINATOR = "the coordinator node of --distributed-config"
    ZERO_CONFIG_COORDINATOR = "a zero-config coordinator (--pp-auto)"
    ZERO_CONFIG_DRY_RUN = "a zero-config dry run (--pp-auto --dry-run)"
    ZERO_CONFIG_PEER = "a zero-config peer (--pp-peer)"


#: values the parser leaves None, so that "given" is exact; applied after the check
SERVE_DEFAULTS: dict[str, object] = {
    "host": "127.0.0.1",
    "port": 8080,
    "parallel": 64,
    "max_choices_per_request": DEFAULT_MAX_CHOICES_PER_REQUEST,
    "max_batch_size": 64,
    "pp_micro_batch_size": "auto",
    "prompt_cache_entries": 8,
    "max_tokens": 64,
    "log_level": "INFO",
    "cluster_discovery": "static",
    "cluster_name": "mlxpp-cluster",
    "cluster_discovery_port": 49555,
    "cluster_discovery_target": "255.255.255.255",
    "cluster_discovery_timeout": 120.0,
}

_COMMON = {"model", "log_level", "ready_file"}
_SECRET = {"cluster_secret_file", "allow_loose_secret_file"}
_NODE = {"distributed_config", "node_id", "node_key_file", "adapter"}
_HTTP = {
    "host",
    "port",
    "alias",
    "api_key",
    "api_key_file",
    "cors_origin",
    "max_choices_per_request",
    "once",
    "max_tokens",
    "tls_cert",
    "tls_key",
}
_PIPELINE = {
    "parallel",
    "pp_micro_batch_size",
    "prompt_cache_entries",
    "prefill_chunk_size",
    "no_warmup",
    "metrics",
    "metrics_port",
    "metrics_ready_file",
    "debug_pp_trace",
    "enable_elastic_pp",
    "elastic_pp_drain_timeout",
    "elastic_pp_pressure_fraction",
    "elastic_pp_cool_down",
    "verbose",
}
_LAYERS = {"kv_budget_bytes", "max_batch_size", "cpu_weights"}
_ZERO = {
    "cluster_discovery",
    "cluster_name",
    "cluster_discovery_port",
    "cluster_control_addr",
    "cluster_config_out",
}
_PLANNING = {"pp_auto", "cluster_peers", "cluster_discovery_timeout"}

#: the one table: the flags (argparse dests) each mode uses
FLAGS_USED: dict[Mode, frozenset[str]] = {
    Mode.IN_PROCESS: frozenset(_COMMON | _HTTP | _LAYERS),
    Mode.LOCAL_CLUSTER: frozenset(
        _COMMON
        | _SECRET
        | _HTTP
        | _PIPELINE
        | _LAYERS
        | {"pp_size", "pp_layers", "tp_size", "transport_port_range", "transport_backend"}
        | {"adapter", "operator"}
    ),
    Mode.STAGE: frozenset(_COMMON | _SECRET | _LAYERS | _NODE | {"pp_peer"}),
    Mode.COORDINATOR: frozenset(_COMMON | _SECRET | _HTTP | _PIPELINE | _NODE),
    Mode.ZERO_CONFIG_COORDINATOR: frozenset(
        _COMMON | _SECRET | _HTTP | _PIPELINE | _ZERO | _PLANNING | {"transport_backend", "adapter"}
    ),
    Mode.ZERO_CONFIG_DRY_RUN: frozenset(
        {"model", "log_level", "host", "port", "dry_run", "transport_backend"}
        | _SECRET
        | _ZERO
        | _PLANNING
    ),
    Mode.ZERO_CONFIG_PEER: frozenset(
        _COMMON | _SECRET | _LAYERS | _ZERO | {"pp_peer", "cluster_discovery_target"}
    ),
}


@dataclass(frozen=True)
class Need:
    """A flag that only acts with another: ``holds(args)`` says whether it can act."""

    holds: Callable[[argparse.Namespace], bool]
    why: str
    #: flags that make it hold (what tests/cli/test_serve_flags.py adds)
    enabling: tuple[str, ...]


_MDNS = Need(
    lambda a: a.cluster_discovery == "mdns",
    "only mdns discovery sends or hears beacons; add --cluster-discovery mdns",
    ("--cluster-discovery", "mdns"),
)
NEEDS: dict[str, Need] = {
    "max_tokens": Need(
        lambda a: a.once is not None,
        "it sizes the --once answer; add --once PROMPT",
        ("--once", "Hi"),
    ),
    "metrics_ready_file": Need(
        lambda a: a.metrics_port is not None,
        "it names the --metrics-port listener; add --metrics-port",
        ("--metrics-port", "0"),
    ),
    "cluster_discovery_port": _MDNS,
    "cluster_discovery_target": _MDNS,
    "cluster_peers": Need(
        lambda a: a.cluster_discovery != "mdns",
        "mdns discovery finds the peers by their beacons; drop --cluster-discovery mdns",
        (),
    ),
}

#: the flags that choose the mode (serve_mode)
SELECTORS = frozenset(
    {"pp_auto", "dry_run", "pp_peer", "distributed_config", "node_id", "pp_size", "pp_layers"}
)

_PIPELINE_HINT = "it needs a pipeline; add --pp-size 2 (or more) or --distributed-config"
_NODE_HINT = "it names a node of a cluster TOML; add --distributed-config"


def _hint(mode: Mode, dest: str) -> str:
    """What to do instead, beyond dropping the flag (may be empty)."""
    if dest == "dry_run":
        return "it plans a --pp-auto cluster; add --pp-auto N"
    if mode in (Mode.ZERO_CONFIG_COORDINATOR, Mode.ZERO_CONFIG_DRY_RUN):
        if dest in ("distributed_config", "pp_layers", "pp_size", "node_id"):
            return "--pp-auto plans the cluster itself (or drop --pp-auto to use your own plan)"
        if dest == "pp_peer":
            return "a process is either the coordinator (--pp-auto) or a peer (--pp-peer)"
    if mode is Mode.ZERO_CONFIG_PEER and dest in ("pp_size", "pp_layers"):
        return "a peer serves the stage the coordinator assigns"
    if mode in (Mode.STAGE, Mode.COORDINATOR) and dest in ("pp_size", "pp_layers"):
        return "the cluster TOML fixes the stages"
    if dest == "tp_size":
        if mode in (Mode.STAGE, Mode.COORDINATOR):
            return "the cluster TOML's tensor_parallel_size fixes the ranks"
        return "ranks belong to a local cluster's stages; add --pp-size 2 (or more)"
    if mode is Mode.IN_PROCESS and dest in _PIPELINE | _SECRET:
        return _PIPELINE_HINT
    if mode in (Mode.IN_PROCESS, Mode.LOCAL_CLUSTER) and dest == "node_id":
        return _NODE_HINT
    if mode in (Mode.STAGE, Mode.ZERO_CONFIG_PEER) and dest in _HTTP | _PIPELINE:
        return "a stage serves no HTTP and holds no requests; give it to the coordinator"
    if dest in _LAYERS:
        return "the coordinator holds no layers; give it to the stages"
    if dest == "cluster_discovery_target" and mode is not Mode.ZERO_CONFIG_PEER:
        if mode in (Mode.ZERO_CONFIG_COORDINATOR, Mode.ZERO_CONFIG_DRY_RUN):
            return (
                "a --pp-peer sends its beacons there; the coordinator hears them on "
                "--cluster-discovery-port"
            )
    if dest in _ZERO | _PLANNING | {"pp_peer", "cluster_discovery_target"}:
        return "it belongs to zero-config bring-up (--pp-auto or --pp-peer)"
    return ""


def flag_of(dest: str) -> str:
    """The flag of an argparse dest (every serve flag is spelled ``--`` + dest with dashes)."""
    return "--" + dest.replace("_", "-")


def given_flags(args: argparse.Namespace) -> set[str]:
    """The dests of the flags given on the command line (not None and not False)."""
    return {
        dest
        for dest, value in vars(args).items()
        if dest not in ("command", "func") and value is not None and value is not False
    }


def serve_mode(args: argparse.Namespace) -> Mode:
    """The mode the mode-selecting flags ask for; reads the cluster TOML of
    ``--distributed-config`` to tell a stage node from the coordinator."""
    if args.pp_auto is not None:
        return Mode.ZERO_CONFIG_DRY_RUN if args.dry_run else Mode.ZERO_CONFIG_COORDINATOR
    if args.pp_peer and not (args.distributed_config and args.node_id):
        return Mode.ZERO_CONFIG_PEER
    if args.distributed_config is not None:
        if not args.node_id:
            raise ConfigurationError("--node-id is required with --distributed-config")
        cluster = load_cluster_config(Path(args.distributed_config))
        node = cluster.find_node(args.node_id)
        if node is None:
            ids = ", ".join(n.id for n in cluster.nodes)
            raise ConfigurationError(
                f"no node '{args.node_id}' in {args.distributed_config}; use one of {ids}",
                source="--node-id",
            )
        return Mode.COORDINATOR if node.role is NodeRole.COORDINATOR else Mode.STAGE
    if args.pp_size is not None or args.pp_layers is not None:
        return Mode.LOCAL_CLUSTER
    return Mode.IN_PROCESS


def check_serve_flags(args: argparse.Namespace) -> Mode:
    """The serve mode, once every flag given is one it uses; else one sentence naming the
    first flag that is not, the mode, and what to do."""
    mode = serve_mode(args)
    given = given_flags(args)
    # A mode-selecting flag first: it says best what the command line mixes up.
    for dest in sorted(given - FLAGS_USED[mode], key=lambda d: (d not in SELECTORS, d)):
        flag = flag_of(dest)
        hint = _hint(mode, dest)
        raise ConfigurationError(
            f"{flag} has no effect on {mode.value}"
            + (f": {hint}" if hint else "")
            + f"; drop {flag}"
        )
    for dest in sorted(given & NEEDS.keys()):
        if not NEEDS[dest].holds(with_defaults(args)):
            flag = flag_of(dest)
            raise ConfigurationError(
                f"{flag} has no effect on {mode.value}: {NEEDS[dest].why}, or drop {flag}"
            )
    if args.cluster_name is not None:
        problem = name_problem(args.cluster_name, "the cluster name")
        if problem is not None:
            raise ConfigurationError(
                f"{problem}; it goes into the cluster TOML", source="--cluster-name"
            )
    return mode


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of ``args`` with ``SERVE_DEFAULTS`` where a flag was not given."""
    filled = argparse.Namespace(**vars(args))
    for dest, value in SERVE_DEFAULTS.items():
        if getattr(filled, dest, None) is None:
            setattr(filled, dest, value)
    return filled
