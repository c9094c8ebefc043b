"""The transport port range: the ``[cluster] transport_port_range`` setting, the pure chooser,
and ``mlxppd serve --pp-size`` taking its stage ports from the range (docs/operations.md)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxppd.core.config.cluster import ClusterSection, load_cluster_config, parse_cluster_config
from mlxppd.core.config.ports import (
    DEFAULT_TRANSPORT_PORT_RANGE,
    PortRange,
    choose_ports,
    parse_port_range,
    with_range_port,
)
from mlxppd.core.config.render import render_cluster_toml
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.runtime.local_cluster import free_ports_in, local_cluster_toml, port_is_free
from tests.support.agents import node_tables

TOML = "[cluster]\npipeline_parallel_size = 2\n{extra}\n\n" + node_tables(
    "127.0.0.1:19100", "127.0.0.1:19101", "127.0.0.1:19102"
)

# -- the setting ------------------------------------------------------------------------------


def test_the_default_range() -> None:
    assert DEFAULT_TRANSPORT_PORT_RANGE == "39600-39629"
    assert ClusterSection(pipeline_parallel_size=2).transport_port_range == "39600-39629"
    assert len(parse_port_range(DEFAULT_TRANSPORT_PORT_RANGE)) == 30


@pytest.mark.parametrize(
    ("text", "start", "end"),
    [("39600-39629", 39600, 39629), (" 1 - 65535 ", 1, 65535), ("5000-5000", 5000, 5000)],
)
def test_ranges_are_read(text: str, start: int, end: int) -> None:
    assert parse_port_range(text) == PortRange(start, end)
    assert list(parse_port_range(text).ports())[::-1][0] == end


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("39600", "is not a port range"),
        ("39600:39629", "is not a port range"),
        ("a-b", "is not a port range"),
        ("-1-5", "is not a port range"),
        ("0-10", "outside 1-65535"),
        ("65000-65536", "outside 1-65535"),
        ("200-100", 'write it as "100-200"'),
    ],
)
def test_bad_ranges_say_how_to_write_one(text: str, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_port_range(text)
    assert fragment in str(info.value)


def test_the_toml_key_is_read_canonical_and_rendered(tmp_path: Path) -> None:
    cfg = parse_cluster_config(TOML.format(extra='transport_port_range = " 41000 - 41009"'), "t")
    assert cfg.cluster.transport_port_range == "41000-41009"
    text = render_cluster_toml(cfg)
    assert 'transport_port_range = "41000-41009"' in text
    assert render_cluster_toml(parse_cluster_config(text, "t")) == text
    # The default is left out, so files that never set it render as before.
    default = render_cluster_toml(parse_cluster_config(TOML.format(extra=""), "t"))
    assert "transport_port_range" not in default


@pytest.mark.parametrize(
    ("value", "fragment"),
    [('"200-100"', "starts after it ends"), ('"x"', "FIRST-LAST"), ("[39600, 39629]", "string")],
)
def test_a_bad_toml_range_names_the_key_and_the_fix(
    tmp_path: Path, value: str, fragment: str
) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(TOML.format(extra=f"transport_port_range = {value}"))
    with pytest.raises(ConfigurationError) as info:
        load_cluster_config(path)
    message = str(info.value)
    assert info.value.key == "cluster.transport_port_range", message
    assert message.startswith(f"{path}: cluster.transport_port_range: "), message
    assert fragment in message, message


# -- the chooser (pure) -----------------------------------------------------------------------


def test_the_first_free_ports_in_order() -> None:
    taken = {100, 102}
    assert choose_ports(PortRange(100, 109), 3, lambda p: p not in taken) == (101, 103, 104)
    assert choose_ports(PortRange(100, 102), 3, lambda p: True) == (100, 101, 102)


def test_an_exhausted_range_names_the_setting_the_range_and_the_fix() -> None:
    with pytest.raises(ConfigurationError) as info:
        choose_ports(PortRange(100, 104), 3, lambda p: p in (100, 104))
    message = str(info.value)
    assert message.startswith("cluster.transport_port_range: "), message
    assert "100-104" in message and "only 2 of the 5 ports" in message, message
    assert "wider range" in message


def test_a_range_smaller_than_the_need_says_how_wide() -> None:
    with pytest.raises(ConfigurationError) as info:
        choose_ports(PortRange(100, 101), 3, lambda p: True, setting="--transport-port-range")
    message = str(info.value)
    assert message.startswith("--transport-port-range: 100-101 holds 2 ports but 3"), message
    assert '"100-102"' in message


# -- the probe and the local cluster's TOML ---------------------------------------------------


def _listening_run(count: int) -> tuple[list[socket.socket], PortRange]:
    """``count`` consecutive loopback ports, each held by a listening socket."""
    for first in range(47000, 60000, count):
        held = []
        for port in range(first, first + count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind(("127.0.0.1", port))
                sock.listen()
            except OSError:
                sock.close()
                break
            held.append(sock)
        if len(held) == count:
            return held, PortRange(first, first + count - 1)
        for sock in held:
            sock.close()
    raise RuntimeError("no run of free loopback ports")


@contextlib.contextmanager
def occupied(count: int) -> Iterator[PortRange]:
    held, port_range = _listening_run(count)
    try:
        yield port_range
    finally:
        for sock in held:
            sock.close()


def test_a_listening_port_is_not_free_and_is_skipped() -> None:
    with occupied(2) as taken:
        assert not port_is_free(taken.start)
        wider = PortRange(taken.start, taken.end + 1)
        if port_is_free(taken.end + 1):
            assert free_ports_in(wider, 1) == (taken.end + 1,)
        with pytest.raises(ConfigurationError, match=str(taken)):
            free_ports_in(taken, 1)


@pytest.mark.parametrize("backend", ["tcp", "thunderbolt", "rdma"])
def test_the_local_cluster_toml_carries_the_backend_and_range(backend: str) -> None:
    ranges = (LayerRange(0, 10), LayerRange(10, 20))
    text = local_cluster_toml(
        ranges,
        [41001, 41002],
        "local",
        coordinator_port=41003,
        transport_backend=backend,
        port_range=PortRange(41001, 41010),
    )
    cfg = parse_cluster_config(text, "local")
    assert cfg.cluster.transport_backend == backend
    assert cfg.cluster.transport_port_range == "41001-41010"
    assert [n.port for n in cfg.stage_nodes()] == [41001, 41002]
    assert cfg.coordinator.port == 41003


# -- mlxppd serve --pp-size ---------------------------------------------------------------------


def _serve(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "mlxppd.cli.mlxppd_main", "serve", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.slow
def test_an_exhausted_range_is_one_error_before_the_model_loads(tmp_path: Path) -> None:
    # No model cache given: the check must come before any model is looked for.
    env = {**os.environ, "MLXPP_MODEL_CACHE": str(tmp_path / "none"), "HF_HUB_OFFLINE": "1"}
    with occupied(3) as taken:
        proc = _serve(env, "--pp-size", "2", "--transport-port-range", str(taken))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "--transport-port-range" in lines[0] and str(taken) in lines[0], lines[0]
    assert "only 0 of the 3 ports" in lines[0], lines[0]
    assert not (tmp_path / "none").exists()


@pytest.mark.slow
def test_a_malformed_range_flag_is_refused(tmp_path: Path) -> None:
    env = {**os.environ, "MLXPP_MODEL_CACHE": str(tmp_path / "none"), "HF_HUB_OFFLINE": "1"}
    proc = _serve(env, "--pp-size", "2", "--transport-port-range", "39629-39600")
    assert proc.returncode == 2, proc.stderr
    assert "--transport-port-range" in proc.stderr and '"39600-39629"' in proc.stderr
    # Without the flag the environment's range counts, and its error names the variable.
    proc = _serve({**env, "MLXPP_TRANSPORT_PORT_RANGE": "x"}, "--pp-size", "2")
    assert proc.returncode == 2, proc.stderr
    assert "MLXPP_TRANSPORT_PORT_RANGE" in proc.stderr and "FIRST-LAST" in proc.stderr


PORTLESS = """\
[cluster]
pipeline_parallel_size = 2
{extra}
[[nodes]]
id = "coordinator"
address = "10.0.0.1"
role = "hybrid"

[[nodes]]
id = "s0"
address = "10.0.0.2:19001"
role = "pipeline_stage"
stage = 0

[[nodes]]
id = "s1"
address = "[fe80::1]"
role = "pipeline_stage"
stage = 1
"""


def test_a_node_without_a_port_takes_one_from_the_range_by_its_place_in_the_file() -> None:
    cluster = parse_cluster_config(PORTLESS.format(extra=""), "cluster.toml")
    assert [n.address for n in cluster.nodes] == [
        "10.0.0.1:39600", "10.0.0.2:19001", "[fe80::1]:39602",
    ]  # fmt: skip
    ranged = parse_cluster_config(
        PORTLESS.format(extra='transport_port_range = "40100-40199"'), "cluster.toml"
    )
    assert ranged.nodes[2].port == 40102 and ranged.nodes[2].host == "fe80::1"


def test_a_range_too_small_for_the_portless_nodes_names_the_setting() -> None:
    text = PORTLESS.format(extra='transport_port_range = "40100-40101"')
    with pytest.raises(ConfigurationError) as caught:
        parse_cluster_config(text, "cluster.toml")
    message = str(caught.value)
    assert "'s1'" in message and "cluster.transport_port_range" in message
    assert "give it a port or widen the range" in message


def test_a_zero_config_host_without_a_port_takes_the_ranges_first() -> None:
    assert with_range_port("10.0.0.2") == "10.0.0.2:39600"
    assert with_range_port("10.0.0.2:19001") == "10.0.0.2:19001"
    assert with_range_port("[fe80::1]") == "[fe80::1]:39600"
