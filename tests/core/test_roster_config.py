"""The cluster TOML's ``[roster]``: each node id with the public key it must prove. A line that
holds no key, or two nodes sharing one, is refused naming the line and the fix; the roster
renders back to the same table, and ``mlxppctl node-key``'s line for any valid id parses."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxppd.core.config.cluster import parse_cluster_config
from mlxppd.core.config.render import render_cluster_toml
from mlxppd.core.config.roster import roster_line
from tests.support.cluster_toml import cluster_toml, refused
from tests.support.node_keys import node_key_for, roster_toml

IDS = ("coord", "a", "b")


def test_the_roster_lists_each_nodes_key() -> None:
    cluster = parse_cluster_config(cluster_toml() + roster_toml(IDS), "t")
    assert cluster.node_roster.node_ids() == set(IDS)
    for node in IDS:
        assert cluster.node_roster.key_of(node) == node_key_for(node).public
    assert cluster.node_roster.key_of("stranger") is None


def test_a_toml_without_a_roster_lists_no_keys() -> None:
    assert len(parse_cluster_config(cluster_toml(), "t").node_roster) == 0


def test_the_roster_renders_back_to_itself() -> None:
    cluster = parse_cluster_config(cluster_toml() + roster_toml(IDS), "t")
    text = render_cluster_toml(cluster)
    assert "\n[roster]\n" in text
    again = parse_cluster_config(text, "again")
    assert again.node_roster == cluster.node_roster
    assert render_cluster_toml(again) == text


def test_a_line_that_holds_no_key_is_refused_naming_it(tmp_path: Path) -> None:
    text = cluster_toml() + '\n[roster]\na = "not-a-key"\n'
    refused(tmp_path, text, "roster.a", "44 characters of base64", "mlxppctl node-key new")


def test_a_key_not_in_quotes_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, cluster_toml() + "\n[roster]\na = 3\n", "roster.a", "expected a string")


def test_two_nodes_sharing_a_key_are_refused(tmp_path: Path) -> None:
    shared = node_key_for("a").public_text
    text = cluster_toml() + f'\n[roster]\na = "{shared}"\nb = "{shared}"\n'
    refused(tmp_path, text, "roster.b", "the same public key as a", "a key of its own")


@pytest.mark.parametrize("node", ["stage-0", "host.lab", "n_1"])
def test_the_printed_roster_line_parses_for_any_node_id(node: str) -> None:
    """An id with a '.' is quoted: bare, TOML would read ``host.lab`` as a nested table."""
    line = roster_line(node, node_key_for(node).public_text)
    cluster = parse_cluster_config(cluster_toml() + f"\n[roster]\n{line}\n", "t")
    assert cluster.node_roster.key_of(node) == node_key_for(node).public
