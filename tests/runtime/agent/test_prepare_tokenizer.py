"""A last stage prepared from nothing compiles output grammars: agents on three hosts (network
namespaces, own model caches), the coordinator's host and stage 0's holding the model, stage 1's
(the last) holding no model files at all. ``mlxppctl prepare`` ships stage 1 its tensors and
the model directory's tokenizer files; the copy's files are the coordinator's, byte for byte,
and a structured-output request (``response_format`` json_schema), whose grammar the last
stage compiles against its own tokenizer, answers JSON that the schema accepts."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxppd.core.protocol.model_transfer import MODEL_FILES
from mlxppd.engine.prepared_copy import prepared_root
from tests.support.agents import in_host_python, netns_unavailable
from tests.support.prepare_cluster import Cluster, identities, prepare_cluster, prepare_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

_WHY = netns_unavailable()
if _WHY is not None:
    pytest.skip(
        f"three-host prepare tests need network namespaces: {_WHY}", allow_module_level=True
    )

SCHEMA = {
    "type": "object",
    "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
    "required": ["color"],
    "additionalProperties": False,
}
STRUCTURED = """
import json, sys, httpx
url, schema = sys.argv[1], json.loads(sys.argv[2])
body = {"messages": [{"role": "user", "content": "Name a color as JSON."}], "max_tokens": 48,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}
r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
print(json.dumps({"status": r.status_code, "body": r.json()}))
"""


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("prepare-tokenizer")
    nothing = root / "host2" / "models" / embedded_model_dir.name
    with prepare_cluster(root, [embedded_model_dir, embedded_model_dir, nothing]) as running:
        yield running


def test_a_last_stage_prepared_from_nothing_answers_structured_output(
    cluster: Cluster, embedded_model_dir: Path
) -> None:
    cluster.wait_status(lambda d: identities(d) == ["verified", "missing"])
    done = subprocess.run(cluster.ctl("prepare"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    document = cluster.wait_status(lambda d: d["health"] == "healthy", timeout=300)
    assert identities(document) == ["verified", "verified"]
    shipped = prepare_of(document, "stage-1")
    assert shipped["found"] == "missing" and shipped["state"] == "done"
    # The copy holds the coordinator's tokenizer files as they are there, and nothing else.
    copy = prepared_root(cluster.cache_dir(2), embedded_model_dir.name) / "current"
    carried = [n for n in MODEL_FILES if (embedded_model_dir / n).is_file()]
    assert "tokenizer.json" in carried
    for name in carried:
        assert (copy / name).read_bytes() == (embedded_model_dir / name).read_bytes(), name
    assert sorted(p.name for p in copy.iterdir()) == sorted(
        ["config.json", "model.safetensors", "prepared.json", *carried]
    )
    answer = in_host_python(cluster.hosts, 0, STRUCTURED, cluster.url, json.dumps(SCHEMA))
    assert answer["status"] == 200, answer
    choice = answer["body"]["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(choice["message"]["content"])
    assert set(value) == {"color"} and value["color"] in ("red", "green", "blue"), value
