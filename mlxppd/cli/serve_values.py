"""``mlxppd serve``'s flags turned into checked values: each in range, pairs that belong
together, and the NodeOptions (or zero-config settings) the node starts from. A bad value is
one ConfigurationError naming the flag and the fix, raised before anything loads."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from mlxppd.cli.serve_modes import Mode
from mlxppd.core.adapters import parse_adapter_flag
from mlxppd.core.config.ports import (
    DEFAULT_TRANSPORT_PORT_RANGE,
    PortRange,
    parse_port_range,
    with_range_port,
)
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.fair_share import MAX_CHOICES_PER_REQUEST, per_client
from mlxppd.wire.operator_key import parse_operator_flags

PORT_RANGE_FLAG = "--transport-port-range"
#: the range a local cluster takes its ports from when the flag is not given
PORT_RANGE_ENV = "MLXPP_TRANSPORT_PORT_RANGE"


def port_range(args: argparse.Namespace) -> PortRange:
    """--transport-port-range, else $MLXPP_TRANSPORT_PORT_RANGE, else the default."""
    source, text = PORT_RANGE_FLAG, args.transport_port_range
    if text is None and os.environ.get(PORT_RANGE_ENV):
        source, text = PORT_RANGE_ENV, os.environ[PORT_RANGE_ENV]
    try:
        return parse_port_range(text or DEFAULT_TRANSPORT_PORT_RANGE)
    except ValueError as exc:
        raise ConfigurationError(str(exc), source=source) from None


def zero_config(args: argparse.Namespace) -> Any:
    from mlxppd.runtime.zeroconf.bringup import ZeroConfig

    # HOST without a port: the first port of the transport port range (39600).
    given = (p.strip() for p in (args.cluster_peers or "").split(","))
    peers = tuple(with_range_port(p) for p in given if p)
    control = args.cluster_control_addr
    return ZeroConfig(
        num_stages=args.pp_auto,
        discovery=args.cluster_discovery,
        peers=peers,
        cluster_name=args.cluster_name,
        discovery_port=args.cluster_discovery_port,
        discovery_target=args.cluster_discovery_target,
        control_addr=with_range_port(control) if control else None,
        config_out=args.cluster_config_out,
        dry_run=args.dry_run,
        discovery_timeout_s=args.cluster_discovery_timeout,
        transport_backend=args.transport_backend or "tcp",
    )


def check_values(args: argparse.Namespace, mode: Mode) -> None:
    """What the mode table cannot say: values in range, and pairs that belong together."""
    if mode in (Mode.ZERO_CONFIG_COORDINATOR, Mode.ZERO_CONFIG_DRY_RUN):
        if args.pp_auto < 2:
            raise ConfigurationError("needs at least 2 stages", source="--pp-auto")
        if args.cluster_discovery == "static" and not args.cluster_peers:
            raise ConfigurationError(
                "static discovery needs --cluster-peers HOST:PORT,... (the peers' "
                "--cluster-control-addr), or use --cluster-discovery mdns",
                source="--pp-auto",
            )
    if mode is Mode.LOCAL_CLUSTER:
        port_range(args)
        if args.pp_size is not None and args.pp_size < 2:
            raise ConfigurationError(
                "a local cluster needs at least 2 stages; drop --pp-size to serve every stage "
                "in this process",
                source="--pp-size",
            )
        if args.tp_size is not None and args.tp_size < 1:
            raise ConfigurationError("needs at least 1 rank per stage", source="--tp-size")
        if (args.tp_size or 1) > 1 and args.enable_elastic_pp:
            raise ConfigurationError(
                "a tensor-parallel stage's ranks load their layers together and cannot move "
                "them while serving; drop --enable-elastic-pp or --tp-size",
                source="--tp-size",
            )
        if args.pp_layers is not None and "," not in args.pp_layers:
            raise ConfigurationError(
                f"{args.pp_layers!r} is one stage, and a local cluster needs at least 2; give "
                "a range per stage, like 0-14,15-29, or drop --pp-layers to serve every stage "
                "in this process",
                source="--pp-layers",
            )
    for flag in args.adapter or ():
        parse_adapter_flag(flag)  # NAME=DIR with a good name, before anything starts
    parse_operator_flags(tuple(args.operator or ()), source="--operator")
    if args.api_key is not None and args.api_key_file is not None:
        raise ConfigurationError(
            "--api-key and --api-key-file both give the key; keep --api-key-file (a key on the "
            "command line shows in ps)",
            source="--api-key",
        )
    cors_origins(args)
    tls_files_of(args, check=True)


def tls_files_of(args: argparse.Namespace, *, check: bool) -> Any:
    """--tls-cert and --tls-key (both or neither); with ``check`` both are read as the listener
    will read them, so a bad file fails before the model loads."""
    from mlxppd.core.config.tls import check_tls_files, tls_files

    files = tls_files(args.tls_cert, args.tls_key, allow_loose=bool(args.allow_loose_secret_file))
    if files is not None and check:
        check_tls_files(files)
    return files


def cors_origins(args: argparse.Namespace) -> tuple[str, ...]:
    """--cors-origin's origins, canonical; '*' with an API key is refused, saying why."""
    from mlxppd.core.config.origins import parse_origins, wildcard_problem

    try:
        origins = parse_origins(args.cors_origin or [])
    except ValueError as exc:
        raise ConfigurationError(str(exc), source="--cors-origin") from None
    keyed = args.api_key is not None or args.api_key_file is not None
    if (problem := wildcard_problem(origins, keyed)) is not None:
        raise ConfigurationError(problem, source="--cors-origin")
    return origins


def node_options(args: argparse.Namespace) -> Any:
    """The flags as NodeOptions, once each is in range (``auto`` micro-batches sized later)."""
    micro = str(args.pp_micro_batch_size)
    if micro != "auto" and not (micro.isdigit() and 1 <= int(micro) <= 256):
        raise ConfigurationError(
            f"{micro!r} is not a size; use a number from 1 to 256 or 'auto'",
            source="--pp-micro-batch-size",
        )
    if args.parallel < 1:
        raise ConfigurationError("must be at least 1", source="--parallel")
    most = min(MAX_CHOICES_PER_REQUEST, per_client(args.parallel))
    if not 1 <= args.max_choices_per_request <= most:
        raise ConfigurationError(
            f"use a number from 1 to {most}: at most {MAX_CHOICES_PER_REQUEST}, and at most "
            f"the {per_client(args.parallel)} sequences one client may hold of --parallel "
            f"{args.parallel} (a request with more choices could never run)",
            source="--max-choices-per-request",
        )
    if args.prefill_chunk_size is not None and not 1 <= args.prefill_chunk_size <= 65536:
        raise ConfigurationError(
            "use a number of tokens from 1 to 65536", source="--prefill-chunk-size"
        )
    if args.max_batch_size < 1:
        raise ConfigurationError("must be at least 1", source="--max-batch-size")
    api_key = args.api_key
    if args.api_key_file is not None:
        from mlxppd.core.config.host import read_api_key_file

        api_key = read_api_key_file(
            args.api_key_file,
            named_by="--api-key-file",
            allow_loose=bool(args.allow_loose_secret_file),
        )
    from mlxppd.cli.agent_command import elastic_overrides
    from mlxppd.runtime.serve import NodeOptions

    return NodeOptions(
        model=args.model,
        cluster_file=args.distributed_config or Path("."),
        node_id=args.node_id or "",
        node_key_file=args.node_key_file,
        secret_file=args.cluster_secret_file,
        host=args.host,
        port=args.port,
        kv_budget_bytes=args.kv_budget_bytes,
        max_sequences=args.max_batch_size,
        parallel=args.parallel,
        max_choices_per_request=args.max_choices_per_request,
        warmup=not args.no_warmup,
        alias=args.alias,
        adapters=tuple(args.adapter or ()),
        api_key=api_key,
        cors_origins=cors_origins(args),
        tls=tls_files_of(args, check=False),
        ready_file=args.ready_file,
        once_prompt=args.once,
        once_max_tokens=args.max_tokens,
        micro_batch_size=0 if micro == "auto" else int(micro),  # 0: auto
        prompt_cache_entries=args.prompt_cache_entries,
        prefill_chunk_size=args.prefill_chunk_size,
        metrics=args.metrics,
        metrics_port=args.metrics_port,
        metrics_ready_file=args.metrics_ready_file,
        trace_path=args.debug_pp_trace,
        cpu_weights=args.cpu_weights,
        log_level=str(args.log_level),
        verbose=bool(args.verbose),
        elastic=tuple(elastic_overrides(args).items()),
    )
