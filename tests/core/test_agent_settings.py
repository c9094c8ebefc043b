"""This host's settings (mlxppd.toml), the node it finds itself to be, and its desired state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxppd.core.agent.desired import config_generation, desired_state, match_node
from mlxppd.core.config.cluster import parse_cluster_config
from mlxppd.core.config.host import (
    DEFAULT_CONFIG_DIR,
    config_dir_from,
    host_json_schema_text,
    load_host_settings,
)
from mlxppd.core.config.tls import TlsFiles
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.layer_ranges import LayerRange
from tests.support.paths import REPO_ROOT
from tests.support.tls import write_pair

EMBEDDED_LIKE = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}

CLUSTER = """\
[cluster]
pipeline_parallel_size = 2
{extra}

[[nodes]]
id = "coordinator"
address = "10.0.0.1:19000"
role = "hybrid"

[[nodes]]
id = "stage-0"
address = "10.0.0.2:19001"
role = "pipeline_stage"
stage = 0

[[nodes]]
id = "stage-1"
address = "10.0.0.3:19001"
role = "pipeline_stage"
stage = 1
"""


def cluster(extra: str = "") -> object:
    return parse_cluster_config(CLUSTER.format(extra=extra), "cluster.toml")


def write(dir_: Path, text: str) -> Path:
    (dir_ / "mlxppd.toml").write_text(text)
    return dir_


# -- precedence -------------------------------------------------------------------------------


def test_defaults_without_a_file(tmp_path: Path) -> None:
    host = load_host_settings(tmp_path, environ={})
    assert (host.node_id, host.http_host, host.http_port, host.log_level) == (
        None,
        "127.0.0.1",
        8080,
        "info",
    )


def test_flags_beat_environment_beat_file_beat_defaults(tmp_path: Path) -> None:
    write(tmp_path, 'http_port = 9000\nhttp_host = "0.0.0.0"\nlog_level = "warning"\n')
    env = {"MLXPP_HTTP_PORT": "9100", "MLXPP_LOG_LEVEL": "error"}
    host = load_host_settings(tmp_path, environ=env, overrides={"log_level": "debug"})
    assert host.http_port == 9100  # environment over file
    assert host.log_level == "debug"  # flag over environment
    assert host.http_host == "0.0.0.0"  # file over default
    assert host.parallel == 64  # default


def test_unset_flags_do_not_override(tmp_path: Path) -> None:
    write(tmp_path, "http_port = 9000\n")
    assert load_host_settings(tmp_path, environ={}, overrides={"http_port": None}).http_port == 9000


def test_other_mlxpp_variables_are_not_settings(tmp_path: Path) -> None:
    env = {"MLXPP_CLUSTER_SECRET": "x" * 32, "MLXPP_MODEL_CACHE": "/tmp", "MLXPP_CONFIG_DIR": "/x"}
    assert load_host_settings(tmp_path, environ=env).node_id is None


def test_config_dir_lookup() -> None:
    assert config_dir_from("/a", {"MLXPP_CONFIG_DIR": "/b"}) == Path("/a")
    assert config_dir_from(None, {"MLXPP_CONFIG_DIR": "/b"}) == Path("/b")
    assert config_dir_from(None, {}) == DEFAULT_CONFIG_DIR


# -- errors name the source -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("http_prot = 1\n", "mlxppd.toml: http_prot: unknown key 'http_prot'; did you mean"),
        ('node_id = "a"\nhttp_port = 70000\n', "http_port: 70000 is out of range; use a value"),
        ('log_level = "loud"\n', "log_level"),
        ("http_port = \n", "not valid TOML"),
        ("max_choices_per_request = 17\n", "max_choices_per_request"),
        # one client holds at most 7 of 8 sequences: 8 choices could never run
        ("parallel = 8\nmax_choices_per_request = 8\n", "one client may hold at most 7"),
    ],
)  # fmt: skip
def test_file_errors_name_file_line_and_key(tmp_path: Path, text: str, expected: str) -> None:
    write(tmp_path, text)
    with pytest.raises(ConfigurationError) as err:
        load_host_settings(tmp_path, environ={})
    assert expected in str(err.value)
    assert str(tmp_path / "mlxppd.toml") in str(err.value)


def test_environment_errors_name_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="environment variable MLXPP_HTTP_PORT"):
        load_host_settings(tmp_path, environ={"MLXPP_HTTP_PORT": "eighty"})


def test_flag_errors_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="--http-port"):
        load_host_settings(tmp_path, environ={}, overrides={"http_port": 70000})


def test_schema_is_checked_in() -> None:
    checked_in = REPO_ROOT / "schemas" / "mlxppd.schema.json"
    assert checked_in.read_text() == host_json_schema_text()
    assert "node_id" in json.loads(checked_in.read_text())["properties"]


# -- which node is this host ------------------------------------------------------------------


def test_node_id_wins() -> None:
    assert match_node(cluster(), "stage-1", lambda h: False).id == "stage-1"


def test_unknown_node_id_lists_the_nodes() -> None:
    with pytest.raises(ConfigurationError, match="'stage-9' is not in cluster.toml.*stage-0"):
        match_node(cluster(), "stage-9", lambda h: True)


def test_found_by_a_local_address() -> None:
    assert match_node(cluster(), None, lambda h: h == "10.0.0.3").id == "stage-1"


def test_no_local_address_says_what_to_set() -> None:
    with pytest.raises(ConfigurationError, match="no node in cluster.toml has an address"):
        match_node(cluster(), None, lambda h: False)


def test_ambiguity_names_the_matching_ids() -> None:
    with pytest.raises(ConfigurationError, match="'coordinator', 'stage-0'"):
        match_node(cluster(), None, lambda h: h in ("10.0.0.1", "10.0.0.2"))


# -- desired state ----------------------------------------------------------------------------


def test_stage_desired_state(tmp_path: Path) -> None:
    cfg = cluster('layers = ["0-9", "10-29"]\nkv_budget_bytes = 1000')
    node = match_node(cfg, "stage-1", lambda h: False)
    host = load_host_settings(tmp_path, environ={})
    desired = desired_state(cfg, host, node, EMBEDDED_LIKE, "g")
    assert desired.coordinator is None and desired.stage is not None
    assert (desired.stage.stage, desired.stage.layers) == (1, LayerRange(10, 30))
    assert (desired.stage.host, desired.stage.port, desired.stage.kv_budget_bytes) == (
        "10.0.0.3",
        19001,
        1000,
    )


def test_host_kv_budget_overrides_the_cluster_one(tmp_path: Path) -> None:
    cfg = cluster("kv_budget_bytes = 1000")
    host = load_host_settings(write(tmp_path, "kv_budget_bytes = 5\n"), environ={})
    desired = desired_state(cfg, host, match_node(cfg, "stage-0", bool), EMBEDDED_LIKE, "g")
    assert desired.stage is not None and desired.stage.kv_budget_bytes == 5


def test_coordinator_desired_state_uses_the_partitioner_without_layers(tmp_path: Path) -> None:
    cfg = cluster()
    host = load_host_settings(write(tmp_path, "http_port = 9000\n"), environ={})
    desired = desired_state(cfg, host, match_node(cfg, "coordinator", bool), EMBEDDED_LIKE, "g")
    assert desired.coordinator is not None
    assert desired.coordinator.http_port == 9000
    assert [s.node_id for s in desired.coordinator.stages] == ["stage-0", "stage-1"]
    assert desired.coordinator.layers == (LayerRange(0, 15), LayerRange(15, 30))


def test_the_coordinators_batching_and_chunks_come_from_the_host_file(tmp_path: Path) -> None:
    cfg = cluster()
    node = match_node(cfg, "coordinator", bool)
    default = desired_state(cfg, load_host_settings(tmp_path, environ={}), node, EMBEDDED_LIKE, "g")
    assert default.coordinator is not None
    # The fast path by default: auto micro-batches, chunks sized by the coordinator.
    assert (default.coordinator.micro_batch_size, default.coordinator.prefill_chunk_size) == (0, 0)
    text = "micro_batch_size = 4\nprefill_chunk_size = 128\n"
    host = load_host_settings(write(tmp_path, text), environ={})
    tuned = desired_state(cfg, host, node, EMBEDDED_LIKE, "g").coordinator
    assert tuned is not None and (tuned.micro_batch_size, tuned.prefill_chunk_size) == (4, 128)
    # Another chunk size needs another pipeline (the agent reconnects it).
    assert tuned.pipeline_key() != default.coordinator.pipeline_key()


def test_layers_beyond_the_model_name_the_cluster_key(tmp_path: Path) -> None:
    cfg = cluster('layers = ["0-9", "10-39"]')
    host = load_host_settings(tmp_path, environ={})
    with pytest.raises(ConfigurationError, match=r"cluster.toml: cluster.layers: .*30 layers"):
        desired_state(cfg, host, match_node(cfg, "stage-0", bool), EMBEDDED_LIKE, "g")


def test_generation_is_a_fingerprint_of_the_file() -> None:
    assert config_generation(b"a") == config_generation(b"a")
    assert config_generation(b"a") != config_generation(b"a ")


def test_the_example_host_file_loads(tmp_path: Path) -> None:
    example = REPO_ROOT / "etc" / "mlxpp" / "mlxppd.toml"
    write(tmp_path, example.read_text())
    host = load_host_settings(tmp_path, environ={})
    assert (host.http_host, host.http_port, host.drain_timeout_s) == ("127.0.0.1", 8080, 120.0)


def test_the_coordinator_serves_https_with_the_host_files_pair(tmp_path: Path) -> None:
    cfg = cluster()
    node = match_node(cfg, "coordinator", bool)
    plain = desired_state(cfg, load_host_settings(tmp_path, environ={}), node, EMBEDDED_LIKE, "g")
    pair = write_pair(tmp_path)
    text = 'tls_cert_file = "server.crt"\ntls_key_file = "server.key"\n'
    host = load_host_settings(write(tmp_path, text), environ={})
    secure = desired_state(cfg, host, node, EMBEDDED_LIKE, "g", allow_loose=True).coordinator
    assert secure is not None and plain.coordinator is not None
    assert secure.tls == TlsFiles(pair.cert, pair.key, "tls_cert_file", "tls_key_file", True)
    # Turning HTTPS on restarts the HTTP listener, not the pipeline.
    assert secure.http_key() != plain.coordinator.http_key()
    assert secure.pipeline_key() == plain.coordinator.pipeline_key()
