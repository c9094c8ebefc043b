"""``mlxppd agent`` (also plain ``mlxppd``) and ``mlxppd check``: the config-directory daemon."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any

from mlxppd.cli.common import cpu_weights_flag
from mlxppd.core.config.private_file import ALLOW_LOOSE_FLAG, ENV_ALLOW_LOOSE

_AGENT_EPILOG = """\
files in the config directory (default /etc/mlxpp, or MLXPP_CONFIG_DIR):
  cluster.toml   the cluster: the same file on every host (see etc/mlxpp/cluster.toml)
  mlxppd.toml    this host: node_id, model, secret_file, http_host, http_port, api_key_file,
                 kv_budget_bytes, cpu_weights, log_level, state_dir, ... (all optional)
precedence: flags > environment MLXPP_<FIELD> (e.g. MLXPP_HTTP_PORT) > mlxppd.toml > defaults

The agent reconciles what runs with the files: at start, when a file changes, on SIGHUP,
and every reconcile_interval_s. A file that fails to load changes nothing (the error is
logged and shown by `mlxppctl status`). SIGTERM drains: no new requests, in-flight ones
finish (up to drain_timeout_s), then exit 0. Under systemd it speaks sd_notify
(Type=notify, READY=1 once serving, WATCHDOG=1).

examples:
  mlxppd check --config-dir /etc/mlxpp
  mlxppd agent --config-dir ./etc/mlxpp --node-id stage-0
"""


def _config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config-dir",
        help="directory with cluster.toml and mlxppd.toml (default: MLXPP_CONFIG_DIR or "
        "/etc/mlxpp)",
    )
    p.add_argument("--node-id", help="this host's node id (default: found by its addresses)")
    p.add_argument("-m", "--model", help="mlx-lm model directory (default: the embedded model)")
    p.add_argument(
        "--cluster-secret-file",
        help="file holding the cluster secret (mode 600; `mlxppctl secret new PATH` makes one)",
    )
    p.add_argument(
        ALLOW_LOOSE_FLAG,
        action="store_true",
        help="use a secret or API key file that fails the permission rule (readable by others, "
        f"another owner, a link), with a warning; as {ENV_ALLOW_LOOSE}=1",
    )
    p.add_argument(
        "--node-key-file",
        help="this host's private node key (mode 600; `mlxppctl node-key new PATH` makes one); "
        "default $MLXPP_NODE_KEY_FILE, then node_key_file in mlxppd.toml, then node.key in "
        "the config directory",
    )
    p.add_argument("--http-host", help="coordinator HTTP listen address (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, help="coordinator HTTP port (default 8080)")
    p.add_argument("--kv-budget-bytes", type=int, help="this stage's KV cache budget, bytes")
    cpu_weights_flag(p, default=None)
    p.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="default: info"
    )


def elastic_flags(p: argparse.ArgumentParser) -> None:
    """The elastic flags (docs/elastic.md); they override [cluster.elastic] of the cluster TOML."""
    g = p.add_argument_group("elastic repartitioning (coordinator; overrides [cluster.elastic])")
    g.add_argument(
        "--enable-elastic-pp",
        action="store_true",
        default=None,
        help="allow `mlxppctl repartition` and memory-pressure repartitions",
    )
    g.add_argument(
        "--elastic-pp-drain-timeout",
        type=float,
        metavar="S",
        help="seconds in-flight requests may take before a repartition fails (default 120)",
    )
    g.add_argument(
        "--elastic-pp-pressure-fraction",
        type=float,
        metavar="F",
        help="a stage's KV fill (0 < F <= 1) that triggers a repartition (default 0.92)",
    )
    g.add_argument(
        "--elastic-pp-cool-down",
        type=float,
        metavar="S",
        help="seconds after a repartition before memory pressure may trigger another (default 30)",
    )


def elastic_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "enabled": args.enable_elastic_pp,
        "drain_timeout_s": args.elastic_pp_drain_timeout,
        "pressure_fraction": args.elastic_pp_pressure_fraction,
        "cool_down_s": args.elastic_pp_cool_down,
    }


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    agent = sub.add_parser(
        "agent",
        help="run this host's node from the config directory (the default command)",
        description="Run this host's part of the cluster declared in the config directory: "
        "a pipeline stage, or the coordinator with the OpenAI and admin HTTP APIs.",
        epilog=_AGENT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _config_flags(agent)
    elastic_flags(agent)
    agent.set_defaults(func=run_agent)
    check = sub.add_parser(
        "check",
        help="validate the config directory without starting anything",
        description="Load cluster.toml, mlxppd.toml and the secret, find this host's node and "
        "its layers, and report. Exit 0 when all is well, 2 with one line naming the file, "
        "line, key and fix otherwise.",
        epilog="example: mlxppd check --config-dir /etc/mlxpp",
    )
    _config_flags(check)
    check.set_defaults(func=run_check)


def default_args() -> argparse.Namespace:
    """Plain ``mlxppd``: the agent with every setting from the files and the environment."""
    parser = argparse.ArgumentParser(prog="mlxppd")
    _config_flags(parser)
    elastic_flags(parser)
    args = parser.parse_args([])
    args.command, args.func = "agent", run_agent
    return args


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "node_id": args.node_id,
        "model": args.model,
        "secret_file": args.cluster_secret_file,
        "node_key_file": args.node_key_file,
        "http_host": args.http_host,
        "http_port": args.http_port,
        "kv_budget_bytes": args.kv_budget_bytes,
        "cpu_weights": args.cpu_weights,
        "log_level": args.log_level,
    }


def _environ(args: argparse.Namespace) -> dict[str, str]:
    """The environment the configuration is read with: --allow-loose-secret-file sets
    MLXPP_ALLOW_LOOSE_SECRET_FILE for every read of the secret and the API key file."""
    environ = dict(os.environ)
    if args.allow_loose_secret_file:
        environ[ENV_ALLOW_LOOSE] = "1"
    return environ


def run_check(args: argparse.Namespace) -> int:
    from mlxppd.core.config.host import config_dir_from
    from mlxppd.runtime.agent.loop import load_configuration
    from mlxppd.runtime.system.host_addresses import is_local_address

    environ = _environ(args)
    config_dir = config_dir_from(args.config_dir, environ)
    desired, context = load_configuration(config_dir, _overrides(args), environ, is_local_address)
    stage = desired.stage
    if stage is not None and stage.layers is not None:
        r = stage.layers
        role = f"pipeline_stage {stage.stage}, layers {r.start}-{r.last}"
    elif stage is not None and stage.awaiting_model:
        role = (
            "pipeline stage without a copy of the model yet: it will listen holding no layers "
            "until `mlxppctl prepare` on the coordinator's host ships its tensors"
        )
    elif stage is not None:
        role = "standby, holding no layers until the coordinator gives it a lost stage's"
    else:
        assert desired.coordinator is not None
        c = desired.coordinator
        ranges = ", ".join(f"{r.start}-{r.last}" for r in c.layers)
        role = f"coordinator, http {c.http_host}:{c.http_port}, stage layers {ranges}"
    print(
        f"configuration ok: node {desired.node_id} ({role}); config generation "
        f"{desired.generation}; secret from {context.secret.origin}; node key "
        f"{context.node_key.public_text} from {context.node_key.origin} (listed in [roster]); "
        "model "
        f"{stage.model_files if stage is not None and stage.model_files else context.model_dir}"
    )
    return 0


def run_agent(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry

    from mlxppd.app.agent_http import start_agent_http
    from mlxppd.core.config.host import config_dir_from, load_host_settings
    from mlxppd.runtime.agent.loop import Agent
    from mlxppd.runtime.observability.metrics import PipelineMetrics
    from mlxppd.runtime.system import event_loop
    from mlxppd.runtime.system.host_addresses import is_local_address
    from mlxppd.runtime.system.sd_notify import SdNotifier
    from mlxppd.runtime.system.service_logging import configure_logging

    environ = _environ(args)
    config_dir = config_dir_from(args.config_dir, environ)
    overrides = _overrides(args)
    # Logging before anything else can fail; the level is re-applied on every reload.
    try:
        level = load_host_settings(
            config_dir, environ=environ, overrides=overrides, read_api_key=False
        ).log_level
    except Exception:
        level = "info"
    configure_logging(level, environ=os.environ, node_id=args.node_id)
    notifier = SdNotifier.from_environ(os.environ, os.getpid())
    agent = Agent(
        config_dir,
        overrides,
        environ,
        is_local=is_local_address,
        notifier=notifier,
        http_starter=start_agent_http,
        metrics=PipelineMetrics(CollectorRegistry()),
        elastic=elastic_overrides(args),
    )

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await agent.run(stop)

    try:
        return event_loop.run(main())
    finally:
        notifier.close()
        sys.stderr.flush()
