"""No flag of ``mlxppd serve`` is accepted and ignored.

Every serve mode x every flag of the parser (introspected, so a new flag is covered without
touching this file): the flag is in the mode's row of ``FLAGS_USED`` (the one table the CLI
refuses from), or passing it is refused with one sentence naming the flag and the mode. Each
pair really goes through the parser and ``check_serve_flags``; nothing starts. The last test
runs a real local cluster with ``--cluster-secret-file`` and talks to it with ``mlxppctl``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from mlxppd.cli.mlxppd_main import build_parser
from mlxppd.cli.serve_modes import (
    FLAGS_USED,
    NEEDS,
    SELECTORS,
    SERVE_DEFAULTS,
    Mode,
    check_serve_flags,
    flag_of,
)
from mlxppd.core.errors import ConfigurationError
from tests.support.agents import node_tables
from tests.support.node_keys import roster_toml

CLUSTER_TOML = (
    '[cluster]\nname = "flags-test"\npipeline_parallel_size = 2\n\n'
    + node_tables("127.0.0.1:19100", "127.0.0.1:19101", "127.0.0.1:19102")
    + roster_toml(["coordinator", "stage-0", "stage-1"])
)


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    serve: argparse.ArgumentParser = sub.choices["serve"]
    return serve


ACTIONS = {a.dest: a for a in serve_parser()._actions if a.dest != "help"}


@pytest.fixture(scope="module")
def toml(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("flags") / "cluster.toml"
    path.write_text(CLUSTER_TOML)
    return str(path)


def base(mode: Mode, toml: str) -> list[str]:
    """A command line of ``mode`` with nothing else on it."""
    return {
        Mode.IN_PROCESS: [],
        Mode.LOCAL_CLUSTER: ["--pp-size", "2"],
        Mode.STAGE: ["--distributed-config", toml, "--node-id", "stage-0"],
        Mode.COORDINATOR: ["--distributed-config", toml, "--node-id", "coordinator"],
        Mode.ZERO_CONFIG_COORDINATOR: ["--pp-auto", "2"],
        Mode.ZERO_CONFIG_DRY_RUN: ["--pp-auto", "2", "--dry-run"],
        Mode.ZERO_CONFIG_PEER: ["--pp-peer"],
    }[mode]


SAMPLES = {"pp_layers": "0-14,15-29", "node_id": "stage-0", "cluster_name": "lab-1"}
SAMPLES |= {"cluster_peers": "127.0.0.1:1,127.0.0.1:2", "cluster_control_addr": "127.0.0.1:2"}
SAMPLES |= {"log_level": "DEBUG", "pp_micro_batch_size": "2", "cluster_discovery": "mdns"}


def sample(dest: str, toml: str) -> list[str]:
    """The flag of ``dest`` with a plausible value."""
    action = ACTIONS[dest]
    flag = flag_of(dest)
    if action.nargs == 0:
        return [flag]
    if dest == "distributed_config":
        return [flag, toml]
    if dest in SAMPLES:
        return [flag, SAMPLES[dest]]
    if action.choices:
        return [flag, str(list(action.choices)[-1])]
    if action.type is int:
        return [flag, "2"]
    if action.type is float:
        return [flag, "0.5"]
    return [flag, "/tmp/mlxpp-flag-test"]


def parse(argv: list[str]) -> argparse.Namespace:
    args: argparse.Namespace = build_parser().parse_args(["serve", *argv])
    return args


# --- the table and the parser agree ---


def test_every_flag_is_spelled_as_its_dest_so_errors_name_it() -> None:
    for dest, action in ACTIONS.items():
        assert flag_of(dest) in action.option_strings, (dest, action.option_strings)


def test_no_default_hides_a_given_flag() -> None:
    """A flag counts as given when it is not None/False, so the parser's defaults are exactly
    that; the real defaults come after the check."""
    for dest, action in ACTIONS.items():
        assert action.default in (None, False), (dest, action.default)
    assert set(SERVE_DEFAULTS) <= set(ACTIONS)


def test_the_table_names_only_real_flags_and_every_flag_has_a_mode() -> None:
    named = set().union(*FLAGS_USED.values())
    assert named <= set(ACTIONS), named - set(ACTIONS)
    assert set(NEEDS) <= set(ACTIONS)
    unused = set(ACTIONS) - named
    assert not unused, f"no serve mode uses {sorted(unused)}: use them or remove them"


# --- every mode x every flag ---

PAIRS = [(mode, dest) for mode in Mode for dest in sorted(ACTIONS)]


@pytest.mark.parametrize(("mode", "dest"), PAIRS, ids=[f"{m.name}-{d}" for m, d in PAIRS])
def test_a_flag_is_used_by_the_mode_or_refused_naming_flag_and_mode(
    mode: Mode, dest: str, toml: str
) -> None:
    flag = flag_of(dest)
    argv = base(mode, toml)
    base_dests = {flag.lstrip("-").replace("-", "_") for flag in argv if flag.startswith("--")}
    if mode is Mode.LOCAL_CLUSTER and dest == "pp_layers":
        argv = sample("pp_layers", toml)  # --pp-size and --pp-layers exclude each other
    elif dest not in base_dests:
        argv = argv + sample(dest, toml)
    if dest in NEEDS and dest in FLAGS_USED[mode]:
        argv = argv + list(NEEDS[dest].enabling)
    assert parse(base(mode, toml)) and check_serve_flags(parse(base(mode, toml))) is mode
    try:
        got = check_serve_flags(parse(argv))
    except ConfigurationError as exc:
        message = str(exc)
        assert flag in message, message
        if dest not in SELECTORS:
            assert dest not in FLAGS_USED[mode], f"{flag} is in the table but refused: {message}"
            assert mode.value in message, message
        return
    if dest in SELECTORS:
        assert dest in FLAGS_USED[got], (argv, got)  # another mode, which uses it
    else:
        assert got is mode
        assert dest in FLAGS_USED[mode], f"{flag} was accepted by {mode} but is not in its row"


@pytest.mark.parametrize("dest", sorted(NEEDS))
def test_a_flag_without_its_companion_is_refused_naming_it(dest: str, toml: str) -> None:
    mode = next(m for m in Mode if dest in FLAGS_USED[m])
    argv = base(mode, toml) + sample(dest, toml)
    if dest == "cluster_peers":  # refused with mdns, which finds the peers itself
        argv += ["--cluster-discovery", "mdns"]
    with pytest.raises(ConfigurationError) as info:
        check_serve_flags(parse(argv))
    assert flag_of(dest) in str(info.value) and mode.value in str(info.value)


@pytest.mark.parametrize("name", ["my cluster", "a/b", "x" * 256])
def test_a_cluster_name_flag_obeys_the_node_id_rules(name: str, toml: str) -> None:
    argv = base(Mode.ZERO_CONFIG_COORDINATOR, toml) + ["--cluster-name", name]
    with pytest.raises(ConfigurationError) as info:
        check_serve_flags(parse(argv))
    assert str(info.value).startswith("--cluster-name: ")
    assert "letters, digits, '.', '_' and '-'" in str(info.value)


def test_a_refused_flag_is_one_line_on_the_real_command_line(toml: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", *base(Mode.STAGE, toml),
         "--api-key", "k"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "mlxppd: error: --api-key has no effect on a pipeline stage node of --distributed-config:"
        " a stage serves no HTTP and holds no requests; give it to the coordinator; drop --api-key"
    ]
