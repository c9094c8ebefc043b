"""A live three-host cluster (agents in network namespaces, as ``test_prepare_cluster.py``)
against a peer that holds the cluster secret and turns the stage's file handling on it: prepare
manifests naming a tensor twice or naming no tensor at all (``__metadata__``, a path, a NUL),
or naming a model file by a path or by a name no prepared copy carries, and an adapter whose
weights file is a symbolic link to the cluster secret, asked for through ``mlxppctl adapter
load`` and straight at the stage.

Stage 1's host starts with one tensor changed, and ``mlxppctl prepare`` installs the cluster's
copy there first: the copy every attack would replace. After each attack the cluster must
answer the same chat, stage 1's copy must still be the verified one on disk, and a normal
prepare (or adapter load) must still work; at the end stage 1 restarts from that copy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxppd.core.stages import StageSpec
from mlxppd.engine.prepared_copy import prepared_root, stage_model_dir
from mlxppd.engine.stage_digest import stage_identity
from tests.support.adapters import random_adapter
from tests.support.agents import netns_unavailable
from tests.support.paths import REPO_ROOT
from tests.support.prepare_cluster import Cluster, identities, prepare_cluster, prepare_of
from tests.support.prepared_copies import one_tensor_changed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

_WHY = netns_unavailable()
if _WHY is not None:
    pytest.skip(f"three-host attack tests need network namespaces: {_WHY}", allow_module_level=True)

STAGE_1 = StageSpec(1, 2, 15, 30)
#: tokens of the chat every check asks: enough to tell the cluster answers as before
ANSWER_TOKENS = 6


def both_verified(document: dict[str, Any]) -> bool:
    """Healthy on the file's two stages, each holding the cluster's copy."""
    return document["health"] == "healthy" and identities(document) == ["verified", "verified"]


class Attacked:
    """The running cluster, what it answered before any attack, and where stage 1's copy is."""

    def __init__(self, cluster: Cluster, model: Path, baseline: str) -> None:
        self.cluster, self.model, self.baseline = cluster, model, baseline
        self.stage_1 = f"{cluster.hosts.addresses[2]}:19001"
        self.copy_root = prepared_root(cluster.cache_dir(2), model.name)

    def attack(self, name: str, *extra: str) -> dict[str, Any]:
        """Run one attack from the coordinator's host (it holds the secret)."""
        done = self.cluster.hosts.run(
            0, sys.executable, "-m", "tests.support.prepared_copies", name,
            str(self.cluster.config_dir(0)), str(self.model), self.stage_1,
            str(STAGE_1.start), str(STAGE_1.end), *extra, cwd=REPO_ROOT,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        result: dict[str, Any] = json.loads(done.stdout)
        return result

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.cluster.ctl(*args), capture_output=True, text=True, timeout=300)

    def assert_still_serving(self) -> None:
        """The same answer, both stages verified, stage 1's copy the verified one on disk, and
        a normal prepare of stage 1 finds it complete and sends nothing."""
        answer = self.cluster.chat(max_tokens=ANSWER_TOKENS)
        assert answer["status"] == 200, answer
        assert answer["body"]["choices"][0]["message"]["content"] == self.baseline
        config = json.loads((self.model / "config.json").read_text())
        copy = stage_model_dir(None, self.copy_root, STAGE_1, config)
        assert copy == self.copy_root / "current"
        assert stage_identity(copy, STAGE_1, config) == stage_identity(self.model, STAGE_1, config)
        done = self.ctl("prepare", "--node", "stage-1")
        assert done.returncode == 0, done.stdout + done.stderr
        document = self.cluster.wait_status(both_verified)
        shipped = prepare_of(document, "stage-1")
        assert (shipped["found"], shipped["bytes_sent"]) == ("present", 0), shipped


@pytest.fixture(scope="module")
def attacked(
    tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path
) -> Iterator[Attacked]:
    root = tmp_path_factory.mktemp("prepare-attacks")
    changed = root / "host2" / "models" / embedded_model_dir.name
    one_tensor_changed(embedded_model_dir, changed)
    with prepare_cluster(root, [embedded_model_dir, embedded_model_dir, changed]) as cluster:
        cluster.wait_status(lambda d: identities(d) == ["verified", "mismatch"])
        done = subprocess.run(cluster.ctl("prepare"), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        cluster.wait_status(both_verified)
        answer = cluster.chat(max_tokens=ANSWER_TOKENS)
        assert answer["status"] == 200, answer
        yield Attacked(
            cluster, embedded_model_dir, answer["body"]["choices"][0]["message"]["content"]
        )


@pytest.fixture(scope="module")
def link_to_the_secret(attacked: Attacked, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter directory whose weights file is a link to the cluster secret file."""
    adapter = random_adapter(attacked.model, tmp_path_factory.mktemp("evil"), num_layers=2)
    (adapter / "adapters.safetensors").unlink()
    (adapter / "adapters.safetensors").symlink_to(attacked.cluster.root / "cluster.secret")
    return adapter


@pytest.mark.parametrize(
    ("attack", "says"),
    [
        ("twice", "'model.layers.20.self_attn.q_proj.weight' is listed twice"),
        ("metadata", "'__metadata__' is the key safetensors reserves"),
        ("path", "'../../../etc/cron.d/x' holds a path separator"),
        ("nul", "'model.norm\\x00.weight' holds a control, format or unassigned character"),
        ("file-up", ".name: '../x' is a path"),
        ("file-dir", ".name: 'a/b' is a path"),
        ("file-unlisted", ".name: 'run.sh' is not one of the files a prepared copy"),
    ],
    ids=["twice", "metadata", "path", "nul", "file-up", "file-dir", "file-unlisted"],
)
def test_a_hostile_manifest_fails_its_prepare_alone(
    attacked: Attacked, attack: str, says: str
) -> None:
    refused = attacked.attack(attack)
    assert not refused["ok"]
    assert refused["error"].startswith(
        "RuntimeError: stage-1 refused the prepare: the prepare manifest was refused: "
    ), refused
    assert says in refused["error"], refused
    field = "files[" if attack.startswith("file-") else "records["
    assert f"the prepare manifest was refused: {field}" in refused["error"], refused
    # Nothing was written where a path would lead (the copy's directory, its parent).
    assert (
        not (attacked.copy_root / "x").exists() and not (attacked.copy_root.parent / "x").exists()
    )
    assert not (attacked.copy_root / "current" / "a").exists()
    attacked.assert_still_serving()


def test_an_adapter_linked_to_the_secret_is_refused_without_a_byte_of_it(
    attacked: Attacked, link_to_the_secret: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    secret = (attacked.cluster.root / "cluster.secret").read_bytes()
    leaks = (
        secret.decode().strip(),
        secret[:8].decode(),
        str(int.from_bytes(secret[:8], "little")),
    )
    weights = link_to_the_secret / "adapters.safetensors"
    through_ctl = attacked.ctl("adapter", "load", "evil", str(link_to_the_secret))
    assert through_ctl.returncode == 1
    assert f"{weights}: is a symbolic link" in through_ctl.stderr, through_ctl.stderr
    at_the_stage = attacked.attack("adapter-link", str(link_to_the_secret))
    assert not at_the_stage["ok"] and at_the_stage["error"].startswith(
        f"{weights}: is a symbolic link"
    ), at_the_stage
    for text in (through_ctl.stdout + through_ctl.stderr, at_the_stage["error"]):
        assert not [leak for leak in leaks if leak in text], text
    # A normal load still works, and serves.
    good = random_adapter(attacked.model, tmp_path_factory.mktemp("good"), num_layers=2)
    loaded = attacked.ctl("adapter", "load", "good", str(good))
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    assert attacked.cluster.chat("good", ANSWER_TOKENS)["status"] == 200
    assert attacked.ctl("adapter", "unload", "good").returncode == 0
    attacked.assert_still_serving()


def test_after_every_attack_stage_1_restarts_from_its_prepared_copy(attacked: Attacked) -> None:
    """Its configured copy still has the changed tensor: verified means the prepared one.
    (Meanwhile stage 0 may serve alone; the file's layout comes back once stage 1 answers.)"""
    cluster = attacked.cluster
    assert cluster.agent(2).stop(timeout=60) == 0
    cluster.start(2)
    cluster.wait_status(both_verified, timeout=300)
    attacked.assert_still_serving()
