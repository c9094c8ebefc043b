"""The cluster TOML (mlxppd.core.config.cluster): what it accepts, refuses, and how it says so.

Every refusal is checked through a real file, so each test also pins the error's shape:
``<file>: <key path>: <what is wrong>; <the fix>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mlxppd.core.config.cluster import (
    ClusterConfig,
    ClusterSection,
    ElasticPolicy,
    FailoverPolicy,
    Node,
    NodeRole,
    cluster_json_schema_text,
    load_cluster_config,
    parse_address,
    parse_cluster_config,
)
from mlxppd.core.config.render import CLUSTER_TOML_HEADER, render_cluster_toml
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import LayerRange
from tests.support.cluster_toml import (
    COORD,
    STAGES_2,
    Table,
    cluster_toml,
    grid_nodes,
    load_text,
    refused,
)
from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
EXAMPLES = ROOT / "etc" / "mlxpp"


# -- helpers ---------------------------------------------------------------------------------


def _standby(name: str = "spare", host: int = 9) -> Table:
    return {"id": name, "address": f"10.0.0.{host}:19001", "role": "standby"}


def _with(nodes: list[dict[str, Any]], index: int, **changes: Any) -> list[dict[str, Any]]:
    out = [dict(n) for n in nodes]
    out[index].update(changes)
    return out


# -- the shipped examples --------------------------------------------------------------------


def test_example_cluster_toml_loads() -> None:
    cfg = load_cluster_config(EXAMPLES / "cluster.toml")
    assert cfg.cluster.pipeline_parallel_size == 2
    assert cfg.coordinator.id == "coordinator"
    assert [n.id for n in cfg.stage_nodes()] == ["stage-0", "stage-1"]


def test_example_2x2_cluster_toml_loads() -> None:
    cfg = load_cluster_config(EXAMPLES / "cluster-2x2.toml")
    assert (cfg.cluster.pipeline_parallel_size, cfg.cluster.tensor_parallel_size) == (2, 2)
    assert cfg.cluster.transport_backend == "rdma"
    assert {n.role for n in cfg.stage_nodes()} == {NodeRole.PIPELINE_TENSOR_PARALLEL}


def test_example_failover_table_spells_out_the_defaults() -> None:
    cfg = load_cluster_config(EXAMPLES / "cluster.toml")
    assert "[cluster.failover]" in (EXAMPLES / "cluster.toml").read_text()
    assert cfg.cluster.failover == FailoverPolicy()


def test_example_standby_node_loads_once_uncommented(tmp_path: Path) -> None:
    text = (EXAMPLES / "cluster.toml").read_text()
    block = (
        '# [[nodes]]\n# id = "standby-0"\n# address = "192.168.1.13:19001"\n# role = "standby"\n'
    )
    assert block in text
    cfg = load_text(tmp_path, text.replace(block, block.replace("# ", "")))
    assert [n.id for n in cfg.standby_nodes()] == ["standby-0"]
    assert [n.id for n in cfg.stage_nodes()] == ["stage-0", "stage-1"]


@pytest.mark.parametrize("name", ["cluster.toml", "cluster-2x2.toml"])
def test_examples_render_stably(name: str) -> None:
    text = render_cluster_toml(load_cluster_config(EXAMPLES / name))
    assert render_cluster_toml(parse_cluster_config(text, name)) == text


def test_a_transport_port_range_renders_after_the_backend_and_round_trips() -> None:
    cfg = parse_cluster_config(cluster_toml({"transport_port_range": "40000 -40009"}), "t")
    text = render_cluster_toml(cfg)
    assert 'transport_backend = "tcp"\ntransport_port_range = "40000-40009"\n' in text
    assert parse_cluster_config(text, "t") == cfg
    assert render_cluster_toml(parse_cluster_config(text, "t")) == text


# -- defaults and accessors ------------------------------------------------------------------


def test_defaults() -> None:
    cfg = parse_cluster_config(cluster_toml(cluster={"name": None}), "t.toml")
    assert cfg.cluster.name == "mlxpp-cluster"
    assert cfg.cluster.tensor_parallel_size == 1
    assert cfg.cluster.transport_backend == "tcp"
    assert cfg.cluster.transport_port_range == "39600-39629"
    assert cfg.cluster.secret_file is None
    assert cfg.cluster.layers is None
    assert cfg.cluster.elastic == ElasticPolicy(
        enabled=False, drain_timeout_s=120.0, pressure_fraction=0.92, cool_down_s=30.0
    )
    assert cfg.cluster.failover == FailoverPolicy(
        enabled=True,
        heartbeat_interval_s=1.0,
        heartbeat_timeout_s=5.0,
        reconnect_grace_s=10.0,
        recovery_timeout_s=600.0,
    )
    assert cfg.standby_nodes() == []


def test_elastic_table_is_read() -> None:
    elastic = {"enabled": True, "drain_timeout_s": 5, "pressure_fraction": 0.5, "cool_down_s": 0}
    cfg = parse_cluster_config(cluster_toml(cluster={"elastic": elastic}), "t.toml")
    assert cfg.cluster.elastic == ElasticPolicy(
        enabled=True, drain_timeout_s=5.0, pressure_fraction=0.5, cool_down_s=0.0
    )


def test_accessors_on_a_2d_cluster() -> None:
    cfg = parse_cluster_config(
        cluster_toml({"tensor_parallel_size": 2}, list(reversed(grid_nodes()))), "t"
    )
    assert cfg.coordinator.id == "coord"
    assert [n.id for n in cfg.stage_nodes()] == ["s0-r0", "s0-r1", "s1-r0", "s1-r1"]
    assert [n.id for n in cfg.nodes_at_stage(1)] == ["s1-r0", "s1-r1"]
    assert [n.id for n in cfg.nodes_at_rank(1)] == ["s0-r1", "s1-r1"]
    assert cfg.find_node("s1-r0") is not None and cfg.find_node("nope") is None


def test_nodes_at_rank_zero_is_every_stage_in_a_pipeline_only_cluster() -> None:
    cfg = parse_cluster_config(cluster_toml(), "t")
    assert [n.id for n in cfg.nodes_at_rank(0)] == ["a", "b"]
    assert cfg.nodes_at_rank(1) == []
    assert [n.id for n in cfg.nodes_at_stage(0)] == ["a"]


def test_node_host_and_port() -> None:
    node = Node(id="x", address="[fe80::1]:19001", role=NodeRole.PIPELINE_STAGE, stage=0)
    assert (node.host, node.port, node.tp_rank) == ("fe80::1", 19001, 0)


def test_models_are_frozen_and_forbid_extra_keys() -> None:
    cfg = parse_cluster_config(cluster_toml(), "t")
    with pytest.raises(ValidationError):
        cfg.cluster.name = "other"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        ElasticPolicy.model_validate({"enabled": True, "surprise": 1})


# -- roles -----------------------------------------------------------------------------------


def test_coordinator_is_an_alias_of_hybrid() -> None:
    cfg = parse_cluster_config(cluster_toml(nodes=_with(STAGES_2, 0, role="coordinator")), "t")
    assert cfg.coordinator.role is NodeRole.COORDINATOR


@pytest.mark.parametrize("alias", ["pp_tp", "2d", "pipeline_tensor_parallel"])
def test_2d_role_aliases(alias: str) -> None:
    cfg = parse_cluster_config(
        cluster_toml({"tensor_parallel_size": 2}, grid_nodes(role=alias)), "t"
    )
    assert all(n.role is NodeRole.PIPELINE_TENSOR_PARALLEL for n in cfg.stage_nodes())


def test_aliases_render_as_the_canonical_role() -> None:
    cfg = parse_cluster_config(
        cluster_toml({"tensor_parallel_size": 2}, grid_nodes(role="2d")), "t"
    )
    text = render_cluster_toml(cfg)
    assert 'role = "pipeline_tensor_parallel"' in text and "2d" not in text


def test_unknown_role(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml(nodes=_with(STAGES_2, 1, role="worker")),
        "nodes[1].role",
        "unknown role 'worker'",
        "'pipeline_stage'",
    )


# -- [cluster] -------------------------------------------------------------------------------


def test_pipeline_needs_at_least_two_stages(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"pipeline_parallel_size": 1}),
        "cluster.pipeline_parallel_size",
        "use a value at least 2",
    )


def test_pipeline_parallel_size_is_required(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"pipeline_parallel_size": None}),
        "cluster.pipeline_parallel_size",
        "required key missing",
    )


def test_pipeline_parallel_size_must_be_an_integer(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"pipeline_parallel_size": "2"}),
        "cluster.pipeline_parallel_size",
        "expected an integer, got a string '2'",
    )


def test_tensor_parallel_size_at_least_one(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"tensor_parallel_size": 0}),
        "cluster.tensor_parallel_size",
        "at least 1",
    )


def test_unknown_transport_backend(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"transport_backend": "udp"}),
        "cluster.transport_backend",
        "'tcp', 'thunderbolt' or 'rdma'",
    )


@pytest.mark.parametrize("backend", ["tcp", "thunderbolt", "rdma"])
def test_transport_backends(backend: str) -> None:
    cfg = parse_cluster_config(cluster_toml({"transport_backend": backend}), "t")
    assert cfg.cluster.transport_backend == backend


@pytest.mark.parametrize("name", ["", "   "])
def test_cluster_name_must_not_be_empty(tmp_path: Path, name: str) -> None:
    refused(tmp_path, cluster_toml({"name": name}), "cluster.name", "the cluster name is empty")


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [("my cluster", "my-cluster"), ("lab/a", "lab-a"), ("café", "caf"), ("x" * 256, "x" * 255)],
)
def test_the_cluster_name_obeys_the_node_id_rules(
    tmp_path: Path, name: str, suggestion: str
) -> None:
    message = refused(
        tmp_path,
        cluster_toml({"name": name}),
        "cluster.name",
        "letters, digits, '.', '_' and '-'",
        "1 to 255 characters",
        "handshake",
        f'rename it, e.g. name = "{suggestion}"',
    )
    assert "(line 2)" in message


def test_a_cluster_name_of_255_allowed_characters_is_accepted() -> None:
    name = "A-z_0.9" + "x" * 248
    assert parse_cluster_config(cluster_toml({"name": name}), "t").cluster.name == name


def test_a_node_id_is_at_most_255_characters(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml(nodes=_with(STAGES_2, 1, id="n" * 256)),
        "nodes[1].id",
        "1 to 255 characters",
    )


def test_missing_cluster_table(tmp_path: Path) -> None:
    text = cluster_toml().split("\n\n", 1)[1]
    refused(tmp_path, text, "cluster", "required key missing; add a [cluster] table")


def test_missing_nodes(tmp_path: Path) -> None:
    refused(tmp_path, cluster_toml(nodes=[]), "nodes", "required key missing", "[[nodes]]")


@pytest.mark.parametrize(
    ("key", "value", "fix"),
    [
        ("pressure_fraction", 0, "use a value above 0"),
        ("pressure_fraction", 1.5, "use a value at most 1"),
        ("drain_timeout_s", -1, "use a value above 0"),
        ("cool_down_s", -0.5, "use a value at least 0"),
        ("enabled", "yes", "expected a boolean (true or false)"),
        ("drain_timeout_s", "120", "expected a number"),
    ],
)
def test_elastic_values(tmp_path: Path, key: str, value: Any, fix: str) -> None:
    refused(tmp_path, cluster_toml({"elastic": {key: value}}), f"cluster.elastic.{key}", fix)


# -- [cluster.failover] -----------------------------------------------------------------------


def test_failover_table_is_read() -> None:
    failover = {
        "enabled": False,
        "heartbeat_interval_s": 0.5,
        "heartbeat_timeout_s": 2,
        "reconnect_grace_s": 3,
        "recovery_timeout_s": 3600,
        "restore_layout": False,
        "restore_after_s": 5,
        "restore_drain_s": 1.5,
    }
    cfg = parse_cluster_config(cluster_toml({"failover": failover}), "t.toml")
    assert cfg.cluster.failover == FailoverPolicy(
        enabled=False,
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=2.0,
        reconnect_grace_s=3.0,
        recovery_timeout_s=3600.0,
        restore_layout=False,
        restore_after_s=5.0,
        restore_drain_s=1.5,
    )


@pytest.mark.parametrize(
    ("key", "value", "fix"),
    [
        ("enabled", "no", "expected a boolean (true or false)"),
        ("heartbeat_interval_s", 0, "use a value above 0"),
        ("heartbeat_interval_s", -1, "use a value above 0"),
        ("heartbeat_timeout_s", 3601, "use a value at most 3600"),
        ("reconnect_grace_s", 0, "use a value above 0"),
        ("reconnect_grace_s", "10", "expected a number"),
        ("recovery_timeout_s", 0, "use a value above 0"),
        ("recovery_timeout_s", 86400, "use a value at most 3600"),
        ("restore_layout", 1, "expected a boolean (true or false)"),
        ("restore_after_s", 0, "use a value above 0"),
        ("restore_drain_s", 3601, "use a value at most 3600"),
    ],
)
def test_failover_values(tmp_path: Path, key: str, value: Any, fix: str) -> None:
    refused(tmp_path, cluster_toml({"failover": {key: value}}), f"cluster.failover.{key}", fix)


@pytest.mark.parametrize(("interval", "timeout"), [(1.0, 2.0), (1.0, 1.5), (2.5, 5.0), (10.0, 5.0)])
def test_heartbeat_timeout_must_outlast_two_intervals(
    tmp_path: Path, interval: float, timeout: float
) -> None:
    failover = {"heartbeat_interval_s": interval, "heartbeat_timeout_s": timeout}
    message = refused(
        tmp_path,
        cluster_toml({"failover": failover}),
        "cluster.failover.heartbeat_timeout_s",
        f"heartbeat_timeout_s = {timeout:g} s is not more than twice heartbeat_interval_s "
        f"({interval:g} s)",
        "one late heartbeat would count a healthy node as lost",
        f"set heartbeat_timeout_s above {2 * interval:g} or lower heartbeat_interval_s",
    )
    assert "(line " in message


def test_heartbeat_timeout_just_over_two_intervals_is_accepted() -> None:
    failover = {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 2.01}
    cfg = parse_cluster_config(cluster_toml({"failover": failover}), "t")
    assert cfg.cluster.failover.heartbeat_timeout_s == 2.01


def test_unknown_failover_key(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"failover": {"heartbeat_timeout": 5}}),
        "cluster.failover.heartbeat_timeout",
        "did you mean 'heartbeat_timeout_s'?",
    )


def test_failover_policy_is_frozen_and_forbids_extra_keys() -> None:
    policy = FailoverPolicy()
    with pytest.raises(ValidationError):
        policy.enabled = False  # type: ignore[misc]
    with pytest.raises(ValidationError):
        FailoverPolicy.model_validate({"enabled": True, "surprise": 1})


# -- cluster.layers --------------------------------------------------------------------------


def test_layers_are_read_and_normalised() -> None:
    cfg = parse_cluster_config(cluster_toml({"layers": ["0 - 14", "15-29"]}), "t")
    assert cfg.cluster.layers == ["0-14", "15-29"]
    assert cfg.cluster.layer_ranges() == (LayerRange(0, 15), LayerRange(15, 30))


def test_layers_need_one_range_per_stage(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"layers": ["0-9", "10-19", "20-29"]}),
        "cluster.layers",
        "3 layer ranges for pipeline_parallel_size = 2",
        "exactly one range per stage",
    )


def test_layers_bad_syntax_names_the_entry(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"layers": ["0-14", "15_29"]}),
        "cluster.layers[1]",
        "'15_29' is not a",
    )


def test_layers_with_a_gap(tmp_path: Path) -> None:
    refused(
        tmp_path, cluster_toml({"layers": ["0-14", "16-29"]}), "cluster.layers", "layer 15 between"
    )


def test_layers_must_start_at_zero(tmp_path: Path) -> None:
    refused(
        tmp_path, cluster_toml({"layers": ["1-14", "15-29"]}), "cluster.layers", "start at layer 0"
    )


def test_layers_overlap(tmp_path: Path) -> None:
    refused(tmp_path, cluster_toml({"layers": ["0-15", "15-29"]}), "cluster.layers", "overlap")


def test_layers_must_not_be_empty(tmp_path: Path) -> None:
    refused(tmp_path, cluster_toml({"layers": []}), "cluster.layers", "must not be empty")


def test_layer_plan_uses_layers_or_an_even_split() -> None:
    explicit = parse_cluster_config(cluster_toml({"layers": ["0-9", "10-29"]}), "t")
    assert explicit.layer_plan(30) == (LayerRange(0, 10), LayerRange(10, 30))
    even = parse_cluster_config(cluster_toml(), "t")
    assert even.layer_plan(30) == (LayerRange(0, 15), LayerRange(15, 30))


def test_layer_plan_checks_the_model_layer_count() -> None:
    cfg = parse_cluster_config(cluster_toml({"layers": ["0-9", "10-29"]}), "t")
    with pytest.raises(ConfigurationError, match="the model has 24 layers") as info:
        cfg.layer_plan(24)
    assert info.value.key == "cluster.layers"


# -- nodes: ids and addresses ----------------------------------------------------------------


@pytest.mark.parametrize("bad_id", ["", "has space", "a/b", "é"])
def test_node_id_characters(tmp_path: Path, bad_id: str) -> None:
    refused(
        tmp_path,
        cluster_toml(nodes=_with(STAGES_2, 1, id=bad_id)),
        "nodes[1].id",
        "letters, digits, '.', '_' and '-'",
    )


def test_node_ids_are_unique(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml(nodes=_with(STAGES_2, 2, id="a")),
        "nodes[2].id",
        "node id 'a' is used by nodes[1] and nodes[2]",
        "give each node a unique id",
    )


def test_node_addresses_are_unique(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml(nodes=_with(STAGES_2, 2, address="10.0.0.2:19001")),
        "nodes[2].address",
        "address '10.0.0.2:19001' is used by nodes 'a' and 'b'",
        "its own host:port",
    )


def test_hostnames_compare_case_insensitively(tmp_path: Path) -> None:
    nodes = _with(_with(STAGES_2, 1, address="Studio.local:1"), 2, address="studio.LOCAL:1")
    refused(tmp_path, cluster_toml(nodes=nodes), "nodes[2].address", "is used by nodes")


@pytest.mark.parametrize(
    ("address", "fragment"),
    [
        ("10.0.0.2:0", "must be a number from 1 to 65535"),
        ("10.0.0.2:70000", "must be a number from 1 to 65535"),
        ("10.0.0.2:http", "must be a number from 1 to 65535"),
        (":19001", "has no host"),
        ("", "has no port"),
        ("fe80::1:19001", "put an IPv6 host in brackets"),
        ("[fe80::1]19001", "is not of the form"),
        ("[not-v6]:19001", "is not an IPv6 address"),
        ("999.1.1.1:80", "is not an IPv4 address"),
        ("bad_host:80", "is not a valid hostname"),
        ("-lead.local:80", "is not a valid hostname"),
        ("0.0.0.0:19001", "is a wildcard"),
        ("[::]:19001", "is a wildcard"),
    ],
)
def test_bad_addresses(tmp_path: Path, address: str, fragment: str) -> None:
    message = refused(
        tmp_path,
        cluster_toml(nodes=_with(STAGES_2, 1, address=address)),
        "nodes[1].address",
        fragment,
    )
    if "form" in fragment or "no port" in fragment or "no host" in fragment:
        assert "'host:port'" in message


@pytest.mark.parametrize(
    ("address", "host", "port"),
    [
        ("192.168.1.11:19001", "192.168.1.11", 19001),
        ("[fe80::1]:1", "fe80::1", 1),
        ("studio-a.local:65535", "studio-a.local", 65535),
        ("localhost:8080", "localhost", 8080),
    ],
)
def test_good_addresses(address: str, host: str, port: int) -> None:
    assert parse_address(address) == (host, port)
    parse_cluster_config(cluster_toml(nodes=_with(STAGES_2, 1, address=address)), "t")


# -- nodes: the coordinator ------------------------------------------------------------------


def test_exactly_one_coordinator_is_required(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml(nodes=STAGES_2[1:]),
        "nodes",
        "no node has role 'hybrid'",
        'add one coordinator node with role = "hybrid"',
    )


def test_two_coordinators_are_refused(tmp_path: Path) -> None:
    extra = {"id": "coord2", "address": "10.0.0.9:19000", "role": "coordinator"}
    refused(
        tmp_path,
        cluster_toml(nodes=[*STAGES_2, extra]),
        "nodes[3].role",
        "nodes 'coord' and 'coord2' both have role 'hybrid'",
        "exactly one coordinator",
    )


@pytest.mark.parametrize("key", ["stage", "rank"])
def test_coordinator_has_no_stage_or_rank(tmp_path: Path, key: str) -> None:
    refused(
        tmp_path,
        cluster_toml(nodes=_with(STAGES_2, 0, **{key: 0})),
        f"nodes[0].{key}",
        "the coordinator 'coord' runs no stage",
        f"remove its {key} key",
    )


# -- nodes: pipeline stages ------------------------------------------------------------------


def test_stage_node_needs_a_stage(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml(nodes=_with(STAGES_2, 1, stage=None)),
        "nodes[1].stage",
        "node 'a' has no stage",
        "set stage to one of 0..1",
    )


def test_stage_must_be_below_pipeline_parallel_size(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml(nodes=_with(STAGES_2, 2, stage=2)),
        "nodes[2].stage",
        "stage 2 but pipeline_parallel_size is 2",
        "use a stage from 0 to 1",
    )


def test_stage_must_not_be_negative(tmp_path: Path) -> None:
    refused(
        tmp_path, cluster_toml(nodes=_with(STAGES_2, 1, stage=-1)), "nodes[1].stage", "at least 0"
    )


def test_each_stage_exactly_once(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml(nodes=_with(STAGES_2, 2, stage=0)),
        "nodes[2].stage",
        "stage 0 appears on nodes 'a' and 'b'",
        "give each stage exactly one node",
    )


def test_every_stage_has_a_node(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"pipeline_parallel_size": 4}),
        "nodes",
        "stages 2, 3 have no node",
        "(line 5)",
        "one 'pipeline_stage' node for each stage 0..3",
    )


def test_pipeline_stage_cannot_claim_a_rank(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml(nodes=_with(STAGES_2, 1, rank=0)),
        "nodes[1].rank",
        "no tensor-parallel rank",
        "remove rank",
    )


# -- nodes: standbys -------------------------------------------------------------------------


def test_standby_nodes_are_read_in_file_order_and_serve_no_stage() -> None:
    nodes = [_standby("spare-b", 8), *STAGES_2, _standby("spare-a", 9)]
    cfg = parse_cluster_config(cluster_toml(nodes=nodes), "t")
    assert [n.id for n in cfg.standby_nodes()] == ["spare-b", "spare-a"]
    assert [n.id for n in cfg.stage_nodes()] == ["a", "b"]
    assert [n.id for n in cfg.nodes_at_rank(0)] == ["a", "b"]
    assert cfg.coordinator.id == "coord"
    spare = cfg.find_node("spare-a")
    assert spare is not None and spare.role is NodeRole.STANDBY
    assert (spare.stage, spare.rank, spare.host, spare.port) == (None, None, "10.0.0.9", 19001)


def test_standbys_are_not_counted_in_pipeline_parallel_size(tmp_path: Path) -> None:
    # Two stages plus a standby is a complete two-stage cluster, not three stages...
    parse_cluster_config(cluster_toml(nodes=[*STAGES_2, _standby()]), "t")
    # ...and a standby does not fill a missing stage.
    refused(
        tmp_path,
        cluster_toml(nodes=[*STAGES_2[:2], _standby()]),
        "nodes",
        "stage 1 has no node",
    )


@pytest.mark.parametrize("key", ["stage", "rank"])
def test_a_standby_has_no_stage_or_rank(tmp_path: Path, key: str) -> None:
    refused(
        tmp_path,
        cluster_toml(nodes=[*STAGES_2, {**_standby(), key: 0}]),
        f"nodes[3].{key}",
        "node 'spare' is a standby, which serves no stage of its own until the coordinator "
        "gives it a lost stage's layers",
        f"remove its {key} key",
    )


def test_a_standby_needs_its_own_id_and_address(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml(nodes=[*STAGES_2, _standby(host=2)]),
        "nodes[3].address",
        "address '10.0.0.2:19001' is used by nodes 'a' and 'spare'",
    )
    refused(
        tmp_path,
        cluster_toml(nodes=[*STAGES_2, _standby("a")]),
        "nodes[3].id",
        "node id 'a' is used",
    )


def test_a_cluster_of_a_coordinator_and_standbys_only_is_refused(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml(nodes=[COORD, _standby("x", 8), _standby("y", 9)]),
        "nodes",
        "have no node",
    )


def test_standbys_render_last_in_file_order() -> None:
    nodes = [_standby("z-spare", 8), *reversed(STAGES_2), _standby("a-spare", 9)]
    text = render_cluster_toml(parse_cluster_config(cluster_toml(nodes=nodes), "t"))
    assert text.endswith(
        '[[nodes]]\nid = "b"\naddress = "10.0.0.3:19001"\nrole = "pipeline_stage"\nstage = 1\n'
        '\n[[nodes]]\nid = "z-spare"\naddress = "10.0.0.8:19001"\nrole = "standby"\n'
        '\n[[nodes]]\nid = "a-spare"\naddress = "10.0.0.9:19001"\nrole = "standby"\n'
    )
    assert render_cluster_toml(parse_cluster_config(text, "again")) == text


# -- nodes: 2D PP x TP -----------------------------------------------------------------------


def test_2d_role_needs_tensor_parallelism(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml(nodes=grid_nodes(2, 1)),
        "nodes[1].role",
        "role 'pipeline_tensor_parallel' but tensor_parallel_size is 1",
        "set cluster.tensor_parallel_size above 1 or use role 'pipeline_stage'",
    )


def test_2d_cluster_cannot_mix_in_pipeline_stage_nodes(tmp_path: Path) -> None:
    nodes = _with(grid_nodes(), 3, role="pipeline_stage", rank=None)
    refused(
        tmp_path,
        cluster_toml({"tensor_parallel_size": 2}, nodes),
        "nodes[3].role",
        "role 'pipeline_stage' but tensor_parallel_size is 2",
        "every stage node has role 'pipeline_tensor_parallel'",
    )


def test_2d_node_needs_a_rank(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"tensor_parallel_size": 2}, _with(grid_nodes(), 2, rank=None)),
        "nodes[2].rank",
        "node 's0-r1' has no rank",
        "set rank to one of 0..1",
    )


def test_2d_node_needs_a_stage(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"tensor_parallel_size": 2}, _with(grid_nodes(), 2, stage=None)),
        "nodes[2].stage",
        "has no stage",
    )


def test_rank_must_be_below_tensor_parallel_size(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"tensor_parallel_size": 2}, _with(grid_nodes(), 2, rank=2)),
        "nodes[2].rank",
        "rank 2 but tensor_parallel_size is 2",
        "use a rank from 0 to 1",
    )


def test_2d_stage_must_be_below_pipeline_parallel_size(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"tensor_parallel_size": 2}, _with(grid_nodes(), 4, stage=2)),
        "nodes[4].stage",
        "stage 2 but pipeline_parallel_size is 2",
    )


def test_each_grid_cell_exactly_once(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"tensor_parallel_size": 2}, _with(grid_nodes(), 4, rank=0)),
        "nodes[4].rank",
        "(stage 1, rank 0) appears on nodes 's1-r0' and 's1-r1'",
        "give each (stage, rank) pair exactly one node",
    )


def test_grid_needs_pp_times_tp_nodes(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"tensor_parallel_size": 2}, grid_nodes()[:-1]),
        "nodes",
        "3 'pipeline_tensor_parallel' nodes but pipeline_parallel_size x tensor_parallel_size = 4",
        "add nodes for (stage 1, rank 1)",
    )


def test_3x2_grid() -> None:
    cfg = parse_cluster_config(
        cluster_toml({"pipeline_parallel_size": 3, "tensor_parallel_size": 2}, grid_nodes(3, 2)),
        "t",
    )
    assert len(cfg.stage_nodes()) == 6
    assert [n.id for n in cfg.nodes_at_rank(0)] == ["s0-r0", "s1-r0", "s2-r0"]


# -- unknown and missing keys ----------------------------------------------------------------


def test_unknown_node_key_suggests_the_right_one(tmp_path: Path) -> None:
    nodes = [dict(n) for n in STAGES_2]
    nodes[1]["adress"] = nodes[1].pop("address")
    message = refused(
        tmp_path,
        cluster_toml(nodes=nodes),
        "nodes[1].adress",
        "unknown key 'adress'; did you mean 'address'?",
    )
    # The typo is reported first; the missing key it causes comes after.
    assert "nodes[1].address: required key missing" in message


def test_unknown_key_reports_its_line(tmp_path: Path) -> None:
    nodes = _with(STAGES_2, 2, adress="x")
    text = cluster_toml(nodes=nodes)
    line = text.splitlines().index('adress = "x"') + 1
    refused(tmp_path, text, "nodes[2].adress", f"(line {line})")


def test_unknown_elastic_key(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"elastic": {"drain_timeout": 5}}),
        "cluster.elastic.drain_timeout",
        "did you mean 'drain_timeout_s'?",
    )


def test_unknown_cluster_key(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"pp_size": 2}),
        "cluster.pp_size",
        "unknown key 'pp_size'",
    )


def test_unknown_key_without_a_close_match_lists_the_known_keys(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml({"elastic": {"zzz": 1}}),
        "cluster.elastic.zzz",
        "known keys: enabled, drain_timeout_s, pressure_fraction, cool_down_s",
    )


def test_misspelt_top_level_table(tmp_path: Path) -> None:
    text = cluster_toml().replace("[cluster]", "[clustr]")
    refused(tmp_path, text, "clustr", "did you mean 'cluster'?", "(line 1)")


def test_missing_node_key_points_at_its_table(tmp_path: Path) -> None:
    text = cluster_toml(nodes=_with(STAGES_2, 2, address=None))
    line = [i for i, t in enumerate(text.splitlines(), 1) if t == "[[nodes]]"][2]
    refused(tmp_path, text, "nodes[2].address", "required key missing", f"(line {line})")


def test_invariant_error_reports_the_key_line(tmp_path: Path) -> None:
    text = cluster_toml(nodes=_with(STAGES_2, 2, stage=0))
    line = [i for i, t in enumerate(text.splitlines(), 1) if t == "stage = 0"][1]
    refused(tmp_path, text, "nodes[2].stage", f"(line {line})")


def test_several_problems_come_in_one_error(tmp_path: Path) -> None:
    nodes = _with(_with(STAGES_2, 1, address="10.0.0.2:0"), 2, adress="x")
    message = refused(tmp_path, cluster_toml(nodes=nodes), "nodes[2].adress", "did you mean")
    assert "also nodes[1].address: port '0' in address '10.0.0.2:0' must be" in message


# -- the file itself -------------------------------------------------------------------------


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    text = cluster_toml().replace('name = "test"', "name = test")
    message = refused(tmp_path, text, None, "not valid TOML", "at line 2", "fix the syntax")
    assert "cluster.toml" in message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigurationError, match="cannot read the cluster TOML") as info:
        load_cluster_config(path)
    assert info.value.source == str(path)


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[cluster]\nname = "caf\xe9"\n')
    with pytest.raises(ConfigurationError, match="not UTF-8"):
        load_cluster_config(path)


def test_parse_names_the_given_source() -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_cluster_config(
            cluster_toml({"pipeline_parallel_size": 1}), "--distributed-config x.toml"
        )
    assert str(info.value).startswith("--distributed-config x.toml: cluster.pipeline_parallel_size")


# -- the JSON Schema -------------------------------------------------------------------------


def test_checked_in_schema_is_current() -> None:
    path = ROOT / "schemas" / "cluster.schema.json"
    assert path.read_text(encoding="utf-8") == cluster_json_schema_text(), (
        "schemas/cluster.schema.json is stale; run: python scripts/gen_schemas.py"
    )


def test_schema_documents_every_field() -> None:
    schema = json.loads(cluster_json_schema_text())
    models = [schema, *schema["$defs"].values()]
    for model in models:
        for name, prop in model["properties"].items():
            assert prop.get("description"), f"{model['title']}.{name} has no description"
    assert set(schema["$defs"]) == {
        "AdapterEntry",
        "ClusterSection",
        "ElasticPolicy",
        "FailoverPolicy",
        "Node",
    }
    assert "standby" in schema["$defs"]["Node"]["properties"]["role"]["enum"]


# -- rendering -------------------------------------------------------------------------------


def test_render_layout() -> None:
    cfg = parse_cluster_config(cluster_toml({"layers": ["0-9", "10-29"], "secret_file": "s"}), "t")
    assert render_cluster_toml(cfg) == (
        CLUSTER_TOML_HEADER + "\n" + "[cluster]\n"
        'name = "test"\n'
        "pipeline_parallel_size = 2\n"
        "tensor_parallel_size = 1\n"
        'transport_backend = "tcp"\n'
        'secret_file = "s"\n'
        'layers = ["0-9", "10-29"]\n'
        "\n"
        "[cluster.elastic]\n"
        "enabled = false\n"
        "drain_timeout_s = 120.0\n"
        "pressure_fraction = 0.92\n"
        "cool_down_s = 30.0\n"
        "\n"
        "[cluster.failover]\n"
        "enabled = true\n"
        "heartbeat_interval_s = 1.0\n"
        "heartbeat_timeout_s = 5.0\n"
        "reconnect_grace_s = 10.0\n"
        "recovery_timeout_s = 600.0\n"
        "restore_layout = true\n"
        "restore_after_s = 30.0\n"
        "restore_drain_s = 30.0\n"
        "\n"
        "[[nodes]]\n"
        'id = "coord"\n'
        'address = "10.0.0.1:19000"\n'
        'role = "hybrid"\n'
        "\n"
        "[[nodes]]\n"
        'id = "a"\n'
        'address = "10.0.0.2:19001"\n'
        'role = "pipeline_stage"\n'
        "stage = 0\n"
        "\n"
        "[[nodes]]\n"
        'id = "b"\n'
        'address = "10.0.0.3:19001"\n'
        'role = "pipeline_stage"\n'
        "stage = 1\n"
    )


def test_header_is_static() -> None:
    # Determinism (docs/zero-config.md): no hostname, pid or clock in the header.
    assert all(line.startswith("# ") for line in CLUSTER_TOML_HEADER.splitlines())
    assert not any(ch.isdigit() for ch in CLUSTER_TOML_HEADER.replace("2020", ""))


def test_strings_with_quotes_and_control_characters_survive() -> None:
    secret = 'dir "x"\\y\tz\x01\x7f\u00e9'
    cfg = parse_cluster_config(cluster_toml({"secret_file": secret}), "t")
    text = render_cluster_toml(cfg)
    assert parse_cluster_config(text, "t").cluster.secret_file == secret


_NAME = st.text(min_size=1, max_size=20).filter(lambda s: s.strip() != "")
_ID = st.from_regex(r"[A-Za-z0-9._-]{1,12}", fullmatch=True)
_HOSTS = ["10.0.0.1", "[fe80::1]", "studio-a.local", "localhost", "[::1]"]


def _failover(draw: st.DrawFn) -> dict[str, Any]:
    seconds = st.floats(0, 3600, exclude_min=True, allow_nan=False)
    interval = draw(st.floats(0.001, 1000, allow_nan=False))
    return {
        "enabled": draw(st.booleans()),
        "heartbeat_interval_s": interval,
        "heartbeat_timeout_s": draw(st.floats(2 * interval, 3600, exclude_min=True)),
        "reconnect_grace_s": draw(seconds),
        "recovery_timeout_s": draw(seconds),
    }


@st.composite
def _configs(draw: st.DrawFn) -> ClusterConfig:
    pp = draw(st.integers(2, 4))
    tp = draw(st.integers(1, 3))
    standbys = draw(st.integers(0, 2))
    count = 1 + pp * tp + standbys
    ids = draw(st.lists(_ID, min_size=count, max_size=count, unique=True))
    ports = draw(st.lists(st.integers(1, 65535), min_size=count, max_size=count, unique=True))
    addresses = [f"{draw(st.sampled_from(_HOSTS))}:{port}" for port in ports]
    nodes: list[dict[str, Any]] = [
        {
            "id": ids[0],
            "address": addresses[0],
            "role": draw(st.sampled_from(["hybrid", "coordinator"])),
        }
    ]
    roles = ["pipeline_stage"] if tp == 1 else ["pipeline_tensor_parallel", "pp_tp", "2d"]
    for i, (stage, rank) in enumerate(((s, r) for s in range(pp) for r in range(tp)), start=1):
        node: Table = {"id": ids[i], "address": addresses[i], "role": draw(st.sampled_from(roles))}
        node["stage"] = stage
        if tp > 1:
            node["rank"] = rank
            # Its own ring address: the default (the port after its address) may be taken.
            node["tp_address"] = f"ring-{i}.example:7000"
        nodes.append(node)
    for i in range(count - standbys, count):
        nodes.append({"id": ids[i], "address": addresses[i], "role": "standby"})
    layers = None
    if draw(st.booleans()):
        sizes = draw(st.lists(st.integers(1, 30), min_size=pp, max_size=pp))
        starts = [sum(sizes[:i]) for i in range(pp)]
        layers = [f"{s}-{s + n - 1}" for s, n in zip(starts, sizes, strict=True)]
    seconds = st.floats(0, 1e6, allow_nan=False, allow_infinity=False)
    cluster = {
        "name": draw(_ID),
        "pipeline_parallel_size": pp,
        "tensor_parallel_size": tp,
        "transport_backend": draw(st.sampled_from(["tcp", "thunderbolt", "rdma"])),
        "transport_port_range": "{}-{}".format(
            *sorted(draw(st.lists(st.integers(1, 65535), min_size=2, max_size=2)))
        ),
        "secret_file": draw(st.none() | _NAME),
        "layers": layers,
        "elastic": {
            "enabled": draw(st.booleans()),
            "drain_timeout_s": draw(seconds.filter(lambda x: x > 0)),
            "pressure_fraction": draw(st.floats(0, 1, exclude_min=True)),
            "cool_down_s": draw(seconds),
        },
        "failover": _failover(draw),
    }
    return ClusterConfig.model_validate({"cluster": cluster, "nodes": draw(st.permutations(nodes))})


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(_configs())
def test_render_load_render_is_byte_identical(cfg: ClusterConfig) -> None:
    text = render_cluster_toml(cfg)
    again = parse_cluster_config(text, "rendered.toml")
    # Same cluster; the nodes come back in rendered order (coordinator, then by stage and rank,
    # then the standbys in their order).
    assert again.cluster == cfg.cluster
    assert again.nodes == [cfg.coordinator, *cfg.stage_nodes(), *cfg.standby_nodes()]
    assert render_cluster_toml(again) == text


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(_configs(), st.randoms(use_true_random=False))
def test_node_order_does_not_change_the_output(cfg: ClusterConfig, rng: Any) -> None:
    shuffled = list(cfg.nodes)
    rng.shuffle(shuffled)
    # Standbys keep their order among themselves: it is the order the coordinator tries them.
    standbys = iter(cfg.standby_nodes())
    shuffled = [next(standbys) if n.role is NodeRole.STANDBY else n for n in shuffled]
    other = ClusterConfig(cluster=cfg.cluster, nodes=shuffled)
    assert render_cluster_toml(other) == render_cluster_toml(cfg)


def test_cluster_section_rejects_unknown_keys_in_python_too() -> None:
    with pytest.raises(ValidationError):
        ClusterSection.model_validate({"pipeline_parallel_size": 2, "extra": 1})


def test_each_rank_joins_its_ring_on_the_port_after_its_address_unless_told() -> None:
    nodes = _with(grid_nodes(), 2, tp_address="10.9.0.1:7000")
    cfg = parse_cluster_config(cluster_toml({"tensor_parallel_size": 2}, nodes), "t")
    assert [n.ring_address for n in cfg.nodes_at_stage(0)] == ["10.0.1.1:8081", "10.9.0.1:7000"]
    # The pipeline talks to rank 0 of each stage only.
    assert [n.id for n in cfg.pipeline_nodes()] == ["s0-r0", "s1-r0"]
    assert 'tp_address = "10.9.0.1:7000"' in render_cluster_toml(cfg)


def test_a_ring_address_taken_by_another_node_is_refused(tmp_path: Path) -> None:
    # s0-r1's ring would default to s0-r0's host and port + 1, where s0-r1 itself listens.
    nodes = _with(grid_nodes(), 2, address="10.0.1.1:8081")
    refused(
        tmp_path,
        cluster_toml({"tensor_parallel_size": 2}, nodes),
        "nodes[1].tp_address",
        "node 's0-r0' would join its tensor-parallel ring on 10.0.1.1:8081",
        "which node 's0-r1' uses already; set tp_address to a free host:port",
    )


def test_tp_address_belongs_to_2d_nodes_only(tmp_path: Path) -> None:
    refused(
        tmp_path,
        cluster_toml(nodes=_with(STAGES_2, 1, tp_address="10.0.0.2:7000")),
        "nodes[1].tp_address",
        "joins no tensor-parallel ring; remove tp_address",
    )
