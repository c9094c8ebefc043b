"""Zero-config planning (mlxppd.core.zeroconf.plan): peers in, a deterministic cluster TOML out.

docs/zero-config.md's bring-up, dry run and operator errors, and determinism:
the same peers in any order give the same bytes, the header carries no host, pid or clock,
the file reads back through the hand-written TOML path, and every refusal says what to change.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxppd.core.config.cluster import ClusterConfig, NodeRole, parse_cluster_config
from mlxppd.core.config.render import CLUSTER_TOML_HEADER, render_cluster_toml
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.profile.model import ModelProfile, profile_from_config
from mlxppd.core.zeroconf.plan import (
    PeerInfo,
    dry_run_problems,
    peer_notes,
    plan_cluster,
    sort_peers,
    topology_summary,
)

# The embedded model's shape (SmolLM2-135M): 30 blocks, tied embeddings.
SMOL: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
PROFILE = profile_from_config(SMOL)
CONTROL = "127.0.0.1:19000"
B = "192.168.1.11:19001"
C = "192.168.1.12:19001"
MiB = 2**20


def plan(
    peers: list[PeerInfo] | list[str],
    num_stages: int = 2,
    *,
    name: str = "mlxpp-cluster",
    control_addr: str = CONTROL,
    profile: ModelProfile = PROFILE,
) -> ClusterConfig:
    infos = [p if isinstance(p, PeerInfo) else PeerInfo(p) for p in peers]
    return plan_cluster(
        name=name, control_addr=control_addr, peers=infos, num_stages=num_stages, profile=profile
    )


def stage_layers(cluster: ClusterConfig) -> list[int]:
    """Layer count per stage."""
    return [r.count for r in cluster.layer_plan(PROFILE.num_layers)]


# -- the plan --------------------------------------------------------------------------------


def test_the_coordinator_comes_first_then_one_stage_per_peer_in_sorted_address_order() -> None:
    cluster = plan([C, B])

    assert [(n.id, n.address, n.role, n.stage) for n in cluster.nodes] == [
        ("coordinator", CONTROL, NodeRole.COORDINATOR, None),
        ("stage-0", B, NodeRole.PIPELINE_STAGE, 0),
        ("stage-1", C, NodeRole.PIPELINE_STAGE, 1),
    ]
    section = cluster.cluster
    assert section.name == "mlxpp-cluster"
    assert section.pipeline_parallel_size == 2
    assert section.tensor_parallel_size == 1
    assert section.transport_backend == "tcp"
    assert section.secret_file is None  # each host passes its own secret
    assert section.layers == ["0-14", "15-29"]  # the balancer's plan, inclusive ranges


def test_peers_are_sorted_as_text_not_as_numbers() -> None:
    # The determinism contract sorts by textual address: "10.0.0.10" < "10.0.0.9".
    peers = [PeerInfo("10.0.0.9:1"), PeerInfo("10.0.0.10:1"), PeerInfo("host-a.local:1")]

    assert [p.address for p in sort_peers(peers)] == [
        "10.0.0.10:1",
        "10.0.0.9:1",
        "host-a.local:1",
    ]


def test_reordered_peers_render_byte_identical_toml() -> None:
    assert render_cluster_toml(plan([B, C])) == render_cluster_toml(plan([C, B]))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 254), st.integers(1024, 65535)),
        min_size=2,
        max_size=5,
        unique=True,
    ).flatmap(lambda peers: st.tuples(st.just(peers), st.permutations(peers)))
)
def test_any_permutation_of_the_peers_renders_the_same_bytes(
    case: tuple[list[tuple[int, int]], list[tuple[int, int]]],
) -> None:
    original, shuffled = case
    first = [f"10.1.2.{host}:{port}" for host, port in original]
    second = [f"10.1.2.{host}:{port}" for host, port in shuffled]

    assert render_cluster_toml(plan(first, len(first))) == render_cluster_toml(
        plan(second, len(second))
    )


def test_the_rendered_header_names_no_host_pid_or_time() -> None:
    text = render_cluster_toml(plan([B, C]))
    header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
    today = datetime.date.today()
    now = datetime.datetime.now()

    assert header == CLUSTER_TOML_HEADER
    for leak in (
        socket.gethostname(),
        str(os.getpid()),
        str(today.year),
        today.isoformat(),
        now.strftime("%H:%M"),
    ):
        assert leak not in header


def test_the_rendered_toml_reads_back_through_the_hand_written_path() -> None:
    cluster = plan([B, C])

    assert parse_cluster_config(render_cluster_toml(cluster), "cluster.toml") == cluster


def test_memory_budgets_move_layers_toward_the_bigger_peer() -> None:
    even = plan([B, C])
    # 150 MiB cannot hold stage 0's even share (~155 MiB), so layers spill to the other peer.
    small_first = plan([PeerInfo(B, memory_bytes=150 * MiB), PeerInfo(C, memory_bytes=4096 * MiB)])
    small_last = plan([PeerInfo(B, memory_bytes=4096 * MiB), PeerInfo(C, memory_bytes=150 * MiB)])

    assert stage_layers(even) == [15, 15]
    assert stage_layers(small_first)[0] < 15
    assert stage_layers(small_last)[1] < 15


def test_ample_memory_everywhere_keeps_the_even_plan() -> None:
    # Memory is a budget, not a weight: when every share fits, stage loads stay balanced.
    roomy = plan([PeerInfo(B, memory_bytes=8192 * MiB), PeerInfo(C, memory_bytes=64 * 1024 * MiB)])

    assert stage_layers(roomy) == [15, 15]


def test_a_peer_without_reported_memory_is_planned_with_the_mean_of_the_others() -> None:
    tight = 150 * MiB
    # Stage 1 is unknown; stages 0 and 2 report 150 MiB and ~250 MiB, so stage 1 gets their mean.
    peers = [
        PeerInfo("10.0.0.1:1", memory_bytes=tight),
        PeerInfo("10.0.0.2:1"),
        PeerInfo("10.0.0.3:1", memory_bytes=250 * MiB),
    ]
    guessed = plan(peers, 3)
    explicit = plan(
        [
            PeerInfo("10.0.0.1:1", memory_bytes=tight),
            PeerInfo("10.0.0.2:1", memory_bytes=200 * MiB),
            PeerInfo("10.0.0.3:1", memory_bytes=250 * MiB),
        ],
        3,
    )

    assert guessed == explicit
    assert peer_notes(peers) == [
        "peer 10.0.0.2:1 did not report its memory; "
        "planned with the mean reported memory (200.0 MiB)"
    ]


def test_when_no_peer_reports_memory_the_plan_has_no_budgets() -> None:
    peers = [PeerInfo(B, reachable=False), PeerInfo(C)]

    assert plan(peers) == plan([B, C])
    assert peer_notes(peers) == [
        f"peer {B} did not answer; planned with equal memory",
        f"peer {C} did not report its memory; planned with equal memory",
    ]


# -- refusals --------------------------------------------------------------------------------


def test_too_few_peers_says_how_to_get_more() -> None:
    with pytest.raises(ConfigurationError) as info:
        plan([B], 2)

    assert str(info.value) == (
        "1 peers resolved, --pp-auto 2 needs 2; add peers to --cluster-peers, check that every "
        "--pp-peer is running and that UDP port 49555 is open, or use static discovery "
        "(--cluster-discovery static with --cluster-peers)"
    )


def test_too_many_peers_names_the_ones_to_drop() -> None:
    with pytest.raises(ConfigurationError) as info:
        plan([C, "192.168.1.13:19001", B], 2)

    message = str(info.value)
    assert message.startswith("--cluster-peers: 3 peers resolved but --pp-auto 2 takes exactly 2")
    assert "drop 192.168.1.13:19001 from --cluster-peers" in message
    assert "or use --pp-auto 3" in message


@pytest.mark.parametrize("again", [B, "192.168.1.11:19001", "[::1]:5", "HOST.local:7"])
def test_a_repeated_peer_address_is_refused(again: str) -> None:
    first = {"[::1]:5": "[0:0::1]:5", "HOST.local:7": "host.local:7"}.get(again, again)

    with pytest.raises(ConfigurationError) as info:
        sort_peers([PeerInfo(first), PeerInfo(C), PeerInfo(again)])

    message = str(info.value)
    assert message.startswith("--cluster-peers: peer address ")
    assert again in message and "given twice" in message and "remove the repeated entry" in message


def test_a_malformed_peer_address_names_the_flag() -> None:
    with pytest.raises(ConfigurationError, match=r"^--cluster-peers: address '192\.168\.1\.11' "):
        plan(["192.168.1.11", C])


@pytest.mark.parametrize("control", ["127.0.0.1", "0.0.0.0:19000", "nohost:99999"])
def test_a_bad_control_address_names_the_flag(control: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        plan([B, C], control_addr=control)

    assert str(info.value).startswith("--cluster-control-addr: ")
    assert "give the coordinator's control address as host:port" in str(info.value)


def test_a_peer_at_the_control_address_is_refused() -> None:
    with pytest.raises(ConfigurationError) as info:
        plan([CONTROL, C])

    assert str(info.value) == (
        f"--cluster-control-addr: peer {CONTROL} is the coordinator's own control address; "
        "give --cluster-control-addr another port or remove it from --cluster-peers"
    )


@pytest.mark.parametrize(
    ("stages", "expected"),
    [
        (1, "--pp-auto: 1 stages requested; zero-config pipelines need at least 2"),
        (31, "--pp-auto: 31 stages requested but the model has 30 layers; use a --pp-auto of"),
    ],
)
def test_an_impossible_stage_count_names_pp_auto(stages: int, expected: str) -> None:
    peers = [f"10.0.0.{i + 1}:1" for i in range(stages)]

    with pytest.raises(ConfigurationError) as info:
        plan(peers, stages)

    assert str(info.value).startswith(expected)


def test_peers_too_small_for_the_model_are_refused_with_what_they_reported() -> None:
    peers = [PeerInfo(B, memory_bytes=64 * MiB), PeerInfo(C, memory_bytes=64 * MiB)]

    with pytest.raises(ConfigurationError) as info:
        plan(peers)

    message = str(info.value)
    assert message.startswith("--pp-auto: the model does not fit the memory the peers reported ")
    assert f"stage-0 {B}: 64.0 MiB, stage-1 {C}: 64.0 MiB" in message
    assert "free memory on the peers, add peers and raise --pp-auto" in message


# -- the dry-run summary -------------------------------------------------------------------------


def test_the_summary_has_the_spec_format() -> None:
    summary = topology_summary(plan([C, B]), "/home/op/.mlxpp/cluster.toml")

    assert summary == (
        "Cluster: mlxpp-cluster\n"
        "  TP size: 1, PP size: 2\n"
        "  Nodes (3):\n"
        "    - coordinator @ 127.0.0.1:19000 [hybrid]\n"
        "    - stage-0 @ 192.168.1.11:19001 [pipeline_stage]\n"
        "    - stage-1 @ 192.168.1.12:19001 [pipeline_stage]\n"
        "  Layers: 0-14, 15-29\n"
        "Emitted cluster TOML at: /home/op/.mlxpp/cluster.toml"
    )


def test_the_summary_lists_notes_before_the_emitted_line() -> None:
    peers = [PeerInfo(B), PeerInfo(C, reachable=False)]
    cluster = plan(peers, name="studio-pp")

    summary = topology_summary(cluster, "cluster.toml", peer_notes(peers))

    assert summary.splitlines()[0] == "Cluster: studio-pp"
    assert summary.splitlines()[-3:] == [
        f"  note: peer {B} did not report its memory; planned with equal memory",
        f"  note: peer {C} did not answer; planned with equal memory",
        "Emitted cluster TOML at: cluster.toml",
    ]


# -- dry-run problems ----------------------------------------------------------------------------


def problems(**overrides: Any) -> list[str]:
    settings: dict[str, Any] = {
        "num_stages": 2,
        "peers_resolved": 2,
        "control_addr": CONTROL,
        "http_addr": "0.0.0.0:8080",
        "bound_ports": (),
    }
    settings.update(overrides)
    return dry_run_problems(**settings)


def test_a_sound_topology_has_no_dry_run_problems() -> None:
    assert problems() == []


def test_too_few_peers_is_a_dry_run_problem_with_the_hint() -> None:
    assert problems(peers_resolved=1) == [
        "1 peers resolved, --pp-auto 2 needs 2; add peers to --cluster-peers, check that every "
        "--pp-peer is running and that UDP port 49555 is open, or use static discovery "
        "(--cluster-discovery static with --cluster-peers)"
    ]
    assert "UDP port 50000 is open" in problems(peers_resolved=0, discovery_port=50000)[0]


@pytest.mark.parametrize(
    ("control", "http", "collides"),
    [
        ("127.0.0.1:19000", "127.0.0.1:19000", True),
        ("127.0.0.1:19000", "0.0.0.0:19000", True),  # the wildcard binds every host
        ("0.0.0.0:19000", "192.168.1.10:19000", True),
        ("[::1]:19000", "[::]:19000", True),
        ("Host.Local:19000", "host.local:19000", True),
        ("127.0.0.1:19000", "0.0.0.0:8080", False),
        ("127.0.0.1:19000", "192.168.1.10:19000", False),  # same port, other interface
    ],
)
def test_the_control_address_must_not_collide_with_http(
    control: str, http: str, collides: bool
) -> None:
    expected = (
        [
            f"the control address {control} collides with the HTTP listen address {http}; "
            "change --cluster-control-addr or --port so they differ"
        ]
        if collides
        else []
    )

    assert problems(control_addr=control, http_addr=http) == expected


def test_each_address_bound_elsewhere_is_a_problem_naming_its_flag() -> None:
    found = problems(bound_ports=[CONTROL, "127.0.0.1:8080", "127.0.0.1:9999"])

    assert found == [
        f"{CONTROL} is already bound by another process; change --cluster-control-addr or "
        "stop the process holding that port",
        "127.0.0.1:8080 is already bound by another process; change --port or stop the "
        "process holding that port",
        "127.0.0.1:9999 is already bound by another process; change --cluster-control-addr or "
        "--port or stop the process holding that port",
    ]


def test_dry_run_problems_come_in_the_spec_order() -> None:
    found = problems(peers_resolved=0, http_addr="0.0.0.0:19000", bound_ports=["0.0.0.0:19000"])

    assert [p.split(" ", 2)[:2] for p in found] == [
        ["0", "peers"],
        ["the", "control"],
        ["0.0.0.0:19000", "is"],
    ]
