"""docs/architecture.md is the design of record: every file and folder it names exists."""

from __future__ import annotations

import re

from tests.support.paths import REPO_ROOT

REPO = REPO_ROOT
DOC = REPO / "docs" / "architecture.md"
# A path: folders and a file with a known ending, or a folder ending in "/".
PATH = re.compile(
    r"(?<![\w.])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|toml|service|plist|json)|(?:[\w.-]+/)+(?!\w))"
)


def named_paths(text: str) -> set[str]:
    return {m.group(1) for m in PATH.finditer(text) if not m.group(1).startswith("http")}


def exists(path: str) -> bool:
    # Diagrams inside the package name modules relative to mlxppd/ (runtime/coordinator.py).
    return (REPO / path).exists() or (REPO / "mlxppd" / path).exists()


def test_every_path_in_the_architecture_doc_exists() -> None:
    paths = named_paths(DOC.read_text())
    assert len(paths) > 40, "the doc should name the places it describes"
    assert sorted(p for p in paths if not exists(p)) == []


def test_the_path_finder_sees_files_folders_and_diagram_names() -> None:
    text = "see `mlxppd/wire/codec.py`, `docs/grafana/` and ──> runtime/agent.py (I/O)"
    assert named_paths(text) == {"mlxppd/wire/codec.py", "docs/grafana/", "runtime/agent.py"}
    assert not exists("mlxppd/wire/no_such_module.py")
