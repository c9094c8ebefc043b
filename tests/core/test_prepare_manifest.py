"""What a node accepts as a prepare manifest (``core/protocol/model_transfer.py``): refused at
the edge, whole, in one sentence naming the field, before any file is touched; a manifest as
``mlxppctl prepare`` sends it passes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxppd.core.protocol.model_transfer import (
    MAX_MODEL_FILE_BYTES,
    ManifestError,
    parse_manifest,
)

RECORD = {"name": "model.layers.0.mlp.up_proj.weight", "dtype": "BF16", "shape": [4, 8],
          "nbytes": 64, "sha256": "ab" * 32}  # fmt: skip
LM_HEAD = {**RECORD, "name": "lm_head.weight"}
MANIFEST = {"model_name": "tiny", "config": {"model_type": "llama"}, "layers": [0, 3],
            "stage": 1, "num_stages": 2, "records": [RECORD, LM_HEAD]}  # fmt: skip


def payload(**changes: Any) -> bytes:
    return json.dumps({**MANIFEST, **changes}).encode()


FILE = {"name": "tokenizer.json", "nbytes": 3000, "sha256": "cd" * 32}


def named(name: str) -> list[dict[str, Any]]:
    return [LM_HEAD, {**RECORD, "name": name}]


def file_named(name: str) -> list[dict[str, Any]]:
    return [FILE, {**FILE, "name": name}]


def test_a_manifest_as_prepare_sends_it_is_accepted() -> None:
    manifest = parse_manifest(payload())
    assert [r.name for r in manifest.records] == [RECORD["name"], "lm_head.weight"]
    assert manifest.files == []  # a manifest from before the tokenizer files travelled
    files = parse_manifest(payload(files=file_named("tokenizer_config.json"))).files
    assert [f.name for f in files] == ["tokenizer.json", "tokenizer_config.json"]


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        (
            {"records": [RECORD, LM_HEAD, RECORD]},
            "records[2].name: 'model.layers.0.mlp.up_proj.weight' is listed twice (records[0] "
            "too); a manifest names each tensor once",
        ),
        (
            {"records": named("__metadata__")},
            "records[1].name: '__metadata__' is the key safetensors reserves for a file's "
            "metadata, not a tensor name",
        ),
        ({"records": named("")}, "records[1].name: String should have at least 1 character"),
        ({"records": named("a/../../b")}, "records[1].name: 'a/../../b' holds a path separator"),
        ({"records": named("a\\b")}, "records[1].name: 'a\\\\b' holds a path separator"),
        ({"records": named("a\x00b")}, "records[1].name: 'a\\x00b' holds a control, format"),
        ({"records": named("a\nb")}, "records[1].name: 'a\\nb' holds a control, format"),
        ({"records": named("x" * 513)}, "records[1].name: String should have at most 512"),
        (
            {"records": [{**RECORD, "nbytes": 65}]},
            "records[0]: nbytes 65 is not what dtype BF16 and shape [4, 8] hold",
        ),
        ({"records": [{**RECORD, "dtype": "Q4"}]}, "records[0]: dtype 'Q4' is not one of BOOL"),
        ({"stage": 2}, "stage: 2 is not below num_stages (2)"),
        ({"layers": [3, 0]}, "layers: [3, 0) ends before it starts"),
        ({"note": "hi"}, "note: Extra inputs are not permitted"),
        ({"files": file_named("../x")}, "files[1].name: '../x' is a path"),
        ({"files": file_named("a/b")}, "files[1].name: 'a/b' is a path"),
        ({"files": file_named("..")}, "files[1].name: '..' is a path"),
        ({"files": file_named("a\\b")}, "files[1].name: 'a\\\\b' is a path"),
        (
            {"files": file_named("model.py")},
            "files[1].name: 'model.py' is not one of the files a prepared copy carries",
        ),
        ({"files": file_named("tokenizer.json")}, "files[1].name: 'tokenizer.json' is listed"),
        (
            {"files": [{**FILE, "nbytes": MAX_MODEL_FILE_BYTES + 1}]},
            f"files[0].nbytes: {MAX_MODEL_FILE_BYTES + 1}; a model file is at most",
        ),
        (
            {
                "files": [
                    {**FILE, "nbytes": MAX_MODEL_FILE_BYTES},
                    {**FILE, "name": "vocab.json", "nbytes": MAX_MODEL_FILE_BYTES},
                    {**FILE, "name": "merges.txt", "nbytes": 1},
                ]
            },
            "files: 134217729 bytes in all; at most 134217728",
        ),  # fmt: skip
        ({"files": [{**FILE, "sha256": "x"}]}, "files[0].sha256: String should match pattern"),
    ],
    ids=[
        "twice",
        "metadata",
        "empty",
        "slash",
        "backslash",
        "nul",
        "newline",
        "long",
        "nbytes",
        "dtype",
        "stage",
        "layers",
        "extra",
        "file-up",
        "file-dir",
        "file-dotdot",
        "file-backslash",
        "file-unlisted",
        "file-twice",
        "file-large",
        "files-large",
        "file-digest",
    ],  # fmt: skip
)
def test_a_bad_manifest_is_refused_in_one_sentence_naming_the_field(
    changes: dict[str, Any], says: str
) -> None:
    with pytest.raises(ManifestError) as refused:
        parse_manifest(payload(**changes))
    message = str(refused.value)
    assert message.startswith("the prepare manifest was refused: " + says), message
    assert "\n" not in message and "x" * 100 not in message  # no echo of the peer's input


def test_a_payload_that_is_not_json_is_a_sentence_too() -> None:
    with pytest.raises(ManifestError, match="^the prepare manifest was refused: Invalid JSON"):
        parse_manifest(b"\xff{")
