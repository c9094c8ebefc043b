"""``mlxppd serve``: its flags, and the runtime for the node's role (the flags' values are checked
and turned into NodeOptions by ``cli/serve_values.py``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlxppd.cli.common import cpu_weights_flag
from mlxppd.cli.serve_modes import Mode, check_serve_flags, with_defaults
from mlxppd.cli.serve_values import (
    PORT_RANGE_ENV,
    PORT_RANGE_FLAG,
    check_values,
    node_options,
    port_range,
    zero_config,
)
from mlxppd.core.config.ports import (
    DEFAULT_TRANSPORT_PORT_RANGE,
)
from mlxppd.core.config.private_file import ALLOW_LOOSE_FLAG, ENV_ALLOW_LOOSE
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.fair_share import (
    DEFAULT_MAX_CHOICES_PER_REQUEST,
    MAX_CHOICES_PER_REQUEST,
)
from mlxppd.wire.operator_key import parse_operator_flags

_EPILOG = """\
roles:
  mlxppd serve --pp-size 2                      local cluster: 2 stage processes on loopback
                                                (a fresh secret, or --cluster-secret-file's)
                                                and the coordinator here
  mlxppd serve --distributed-config cluster.toml --node-id ID
                                                one node of a multi-host cluster: the
                                                coordinator (role hybrid) serves HTTP, a
                                                pipeline_stage node serves its layers
  mlxppd serve                                  every stage in this process
A flag the role does not use is refused, naming the flag and the role.

examples:
  mlxppd serve --pp-size 2 --port 8080
  mlxppd serve --pp-size 2 --once "What is the capital of France?"
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the model (OpenAI-compatible HTTP API on the coordinator)",
        description="Serve a model split into pipeline stages. The coordinator serves the "
        "OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models, /health) "
        "and drives the stages over the authenticated, encrypted transport.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-m", "--model", help="mlx-lm model directory (default: the embedded model)")
    # Defaults stay None here (mlxppd.cli.serve_modes.SERVE_DEFAULTS fills them after the
    # check), so that a flag given to a mode that does not use it is always seen.
    p.add_argument("--host", help="HTTP listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8080; 0: any)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--pp-size", type=int, help="stages of a local cluster (>= 2)")
    split.add_argument("--pp-layers", help='inclusive layer range per stage, "0-14,15-29"')
    p.add_argument(
        "--tp-size",
        type=int,
        help="tensor-parallel ranks per stage of a local cluster (default 1): each stage is "
        "that many processes, each holding its shard of the stage's layers (MLX's ring "
        "backend on loopback; docs/tensor-parallel.md)",
    )
    p.add_argument(
        "--transport-port-range",
        metavar="FIRST-LAST",
        help="TCP ports a local cluster's stages and coordinator take theirs from, the first "
        f"free ones (default ${PORT_RANGE_ENV}, else {DEFAULT_TRANSPORT_PORT_RANGE})",
    )
    p.add_argument(
        "--transport-backend",
        choices=("tcp", "thunderbolt", "rdma"),
        help="transport between the stages of a local cluster (--pp-size) or a zero-config "
        "one (--pp-auto; written into the cluster TOML it plans); default tcp",
    )
    p.add_argument("--distributed-config", type=Path, help="cluster TOML of a multi-host cluster")
    p.add_argument("--node-id", help="this node's id in --distributed-config")
    p.add_argument(
        "--node-key-file",
        help="this node's private key (mode 600; `mlxppctl node-key new PATH` makes one, its "
        "public half goes under [roster]); default $MLXPP_NODE_KEY_FILE, then node.key beside "
        "--distributed-config",
    )
    p.add_argument(
        "--cluster-secret-file",
        help="file holding the cluster secret (mode 600; `mlxppctl secret new PATH` makes one); "
        "a local cluster uses it instead of a fresh one",
    )
    p.add_argument(
        ALLOW_LOOSE_FLAG,
        action="store_true",
        help="use a secret or API key file that fails the permission rule (readable by others, "
        f"another owner, a link), with a warning; as {ENV_ALLOW_LOOSE}=1",
    )
    p.add_argument(
        "--kv-budget-bytes", type=int, help="KV cache budget of each stage, bytes (default: none)"
    )
    p.add_argument(
        "--parallel",
        type=int,
        help="sequences the coordinator generates at once, every choice of n counting; when "
        "all are taken a client within its fair share waits, one over it gets 503 (default 64)",
    )
    p.add_argument(
        "--max-choices-per-request",
        type=int,
        help=f"the most choices (n) one request may ask for, 1 to {MAX_CHOICES_PER_REQUEST} "
        f"(default {DEFAULT_MAX_CHOICES_PER_REQUEST})",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        help="sequences each stage holds KV for; more are refused with 503 (default 64)",
    )
    p.add_argument(
        "--pp-micro-batch-size",
        help="decode steps of up to N sequences run as one batched forward pass (1: each "
        "sequence alone); default 'auto': one micro-batch per stage, the streams spread "
        "evenly over them, so every stage computes while the others do",
    )
    p.add_argument(
        "--prefill-chunk-size",
        type=int,
        metavar="N",
        help="prompt tokens per prefill pass; default: chosen per prompt (about four chunks per "
        "stage, so the stages work on different chunks at once; 16 while other streams "
        "decode, so they keep getting tokens)",
    )
    p.add_argument(
        "--prompt-cache-entries",
        type=int,
        metavar="N",
        help="prompt prefixes every stage keeps for reuse (a chat's next turn prefills only "
        "its new tokens), evicted least recently used and when a stage's KV budget is full; "
        "0: none (default 8)",
    )
    cpu_weights_flag(p, default=None)
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up request at start")
    p.add_argument("--alias", help="model name reported by /v1/models (default: directory name)")
    p.add_argument(
        "--adapter",
        action="append",
        metavar="[NAME=]DIR",
        help="a LoRA/DoRA adapter directory (mlx_lm lora's, or PEFT's): DIR is fused into every "
        "stage's weights; NAME=DIR (repeatable) is kept apart and runs for requests whose "
        "model is NAME. Each stage reads only its layers' tensors",
    )
    p.add_argument(
        "--operator",
        action="append",
        metavar="NAME=PUBLIC_KEY",
        help="a local cluster's [operators] entry (repeatable; the line `mlxppctl operator-key "
        "new` prints): only these keys then sign admin requests, not the cluster secret",
    )
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1 routes (shows in ps; prefer "
        "--api-key-file)",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        metavar="PATH",
        help="file holding the key for --api-key, mode 600 like the cluster secret",
    )
    p.add_argument(
        "--tls-cert",
        type=Path,
        metavar="FILE",
        help="serve HTTPS on the HTTP listeners (API, admin API, console, --metrics-port) with "
        "this PEM certificate; needs --tls-key (`mlxppctl tls self-signed` makes a pair)",
    )
    p.add_argument(
        "--tls-key",
        type=Path,
        metavar="FILE",
        help="the unencrypted PEM private key of --tls-cert, mode 600 like the cluster secret",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        metavar="ORIGIN",
        help="let web pages from ORIGIN (scheme://host[:port]; '*': every origin, only "
        "without an API key) call the API from a browser (CORS; repeatable; default: none)",
    )
    p.add_argument(
        "--once",
        metavar="PROMPT",
        help="start, send PROMPT as one chat request over HTTP, print the answer, stop",
    )
    p.add_argument("--max-tokens", type=int, help="max_tokens for --once (default 64)")
    p.add_argument(
        "--metrics", action="store_true", help="serve Prometheus metrics at /metrics (coordinator)"
    )
    p.add_argument(
        "--metrics-port", type=int, help="serve /metrics on this port too (0: any free port)"
    )
    p.add_argument(
        "--debug-pp-trace",
        type=Path,
        metavar="PATH",
        help="write a Chrome/Perfetto trace of every node to PATH on graceful shutdown",
    )
    p.add_argument("--ready-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--metrics-ready-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--log-level", help="log level (default INFO)")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="log the partition quality report once the stages load (as generate --verbose)",
    )
    from mlxppd.cli.agent_command import elastic_flags

    elastic_flags(p)
    _zero_config_flags(p)
    p.set_defaults(func=run)


def _zero_config_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "zero-config bring-up (no hand-written cluster TOML; see docs/zero-config.md)"
    )
    g.add_argument(
        "--pp-auto",
        type=int,
        metavar="N",
        help="coordinator: find N --pp-peer processes, plan N stages, push one assignment to "
        "each, then serve (runs no stage itself)",
    )
    g.add_argument(
        "--pp-peer",
        action="store_true",
        help="wait on --cluster-control-addr for a stage assignment from a --pp-auto "
        "coordinator, then serve it (with --distributed-config and --node-id: use that TOML)",
    )
    g.add_argument(
        "--cluster-discovery",
        choices=["static", "mdns"],
        help="static: --cluster-peers as given; mdns: HMAC-signed UDP beacons (default static)",
    )
    g.add_argument(
        "--cluster-peers",
        metavar="ADDR,...",
        help="peers' host:port, comma-separated (a host without :PORT means port 39600)",
    )
    g.add_argument(
        "--cluster-name",
        help="cluster name in the emitted TOML (letters, digits, '.', '_', '-'); scopes beacons "
        "(default mlxpp-cluster)",
    )
    g.add_argument(
        "--cluster-discovery-port",
        type=int,
        help="UDP port of the discovery beacons (default 49555)",
    )
    g.add_argument(
        "--cluster-discovery-target",
        help="where a peer sends its beacons: a broadcast address or the coordinator's IP "
        "(default 255.255.255.255)",
    )
    g.add_argument(
        "--cluster-control-addr",
        metavar="HOST:PORT",
        help="coordinator: its address in the plan (default --host:39600); peer: where it "
        "listens for the assignment and then serves (mdns default 0.0.0.0:0); a HOST "
        "without :PORT takes the transport port range's first port, 39600",
    )
    g.add_argument(
        "--cluster-config-out",
        type=Path,
        metavar="PATH",
        help="where the cluster TOML is written (coordinator default .mlxpp/cluster.toml; "
        "peer default .mlxpp/cluster-<node-id>.toml)",
    )
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="with --pp-auto: plan, print the topology, write the TOML, start nothing",
    )
    g.add_argument(
        "--cluster-discovery-timeout",
        type=float,
        metavar="S",
        help="seconds to wait for the peers (default 120)",
    )


async def _run_auto(options: Any, zero: Any) -> int:
    from mlxppd.app.serve_node import run_coordinator_node
    from mlxppd.runtime.zeroconf.bringup import coordinate

    planned = await coordinate(options, zero)
    if isinstance(planned, int):
        return planned
    return await run_coordinator_node(planned)


async def _run_peer(options: Any, zero: Any) -> int:
    from mlxppd.runtime.serve import run_stage_node
    from mlxppd.runtime.zeroconf.bringup import await_assignment

    assigned = await await_assignment(options, zero)
    return await run_stage_node(assigned)


def exit_now(code: int) -> None:
    """Leave without interpreter teardown, once everything is closed and flushed.

    A process that ran mlx on a worker thread can abort in mlx's native thread cleanup during
    teardown; a served process has nothing left to tear down, so it skips it.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(args: argparse.Namespace) -> int:
    # Every flag given is one this mode uses (mlxppd.cli.serve_modes), before anything starts.
    mode = check_serve_flags(args)
    args = with_defaults(args)
    check_values(args, mode)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.allow_loose_secret_file:
        # Every secret read in this process and in a local cluster's stage processes.
        os.environ[ENV_ALLOW_LOOSE] = "1"
    options = node_options(args)
    # Imported once the flags are checked: a flag error answers in a fraction of a second.
    from mlxppd.runtime.system import event_loop

    if mode is Mode.STAGE:
        # A stage never serves HTTP: without the API's modules it starts ~0.6 s of CPU sooner
        # (every start and every restart after a failover).
        from mlxppd.runtime.serve import run_stage_node

        return event_loop.run(run_stage_node(options))
    if mode in (Mode.ZERO_CONFIG_COORDINATOR, Mode.ZERO_CONFIG_DRY_RUN):
        return event_loop.run(_run_auto(options, zero_config(args)))
    if mode is Mode.ZERO_CONFIG_PEER:
        return event_loop.run(_run_peer(options, zero_config(args)))
    from mlxppd.app.serve_node import run_coordinator_node

    if mode is Mode.COORDINATOR:
        return event_loop.run(run_coordinator_node(options))
    return _run_local(args, options)


def _run_local(args: argparse.Namespace, options: Any) -> int:
    """No cluster TOML: a local cluster of --pp-size stages, or every stage in this process."""
    from mlxppd.app.serve_node import run_inprocess, run_local_cluster
    from mlxppd.core.cpu_weights import CpuWeights, held_config
    from mlxppd.core.layer_ranges import parse_pp_layers
    from mlxppd.core.partition.plan import balance_compute
    from mlxppd.core.profile.model import profile_from_config, read_model_config
    from mlxppd.engine.cpu_weights import resolve_for_process
    from mlxppd.engine.families import single_process_reason
    from mlxppd.engine.model_files import resolve_model_dir
    from mlxppd.engine.tensor_parallel import tp_refusal
    from mlxppd.runtime.local_cluster import free_ports_in
    from mlxppd.runtime.system import event_loop

    ports = port_range(args)
    if args.pp_size is not None or args.pp_layers is not None:
        # A range without room is one error before the model loads (the stages and the
        # coordinator; the cluster takes its ports again when it starts).
        stages = args.pp_size or len(args.pp_layers.split(","))
        free_ports_in(ports, stages * (args.tp_size or 1) + 1, setting=PORT_RANGE_FLAG)
    model_dir = resolve_model_dir(args.model)
    config = read_model_config(model_dir)
    # Every stage runs on this host: balance the layers as the stages will hold them.
    weights, _ = resolve_for_process(args.cpu_weights or CpuWeights.AUTO, config)
    profile = profile_from_config(held_config(config, weights))
    if args.pp_layers is not None:
        ranges = parse_pp_layers(args.pp_layers, profile.num_layers, profile.adjacency_groups)
    else:
        # One host's memory holds every stage: balance their time per token, not their bytes
        # (no stage boundary inside an adjacency group either way).
        ranges = balance_compute(profile, args.pp_size or 1)
    refusal = single_process_reason(config) or profile.pipeline_refusal
    if refusal and len(ranges) > 1:
        raise ConfigurationError(refusal, source="--pp-size/--pp-layers")
    tp = args.tp_size or 1
    tp_refused = tp_refusal(config, tp)
    if tp_refused is not None:
        raise ConfigurationError(tp_refused, source="--tp-size")
    options = replace(options, model=str(model_dir))
    if len(ranges) >= 2:
        return int(
            run_local_cluster(
                options,
                ranges,
                port_range=ports,
                transport_backend=args.transport_backend or "tcp",
                tp=tp,
                operators=parse_operator_flags(tuple(args.operator or ()), source="--operator"),
            )
        )
    return int(event_loop.run(run_inprocess(options, model_dir)))
