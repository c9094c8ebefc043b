"""No two modules of mlxppd import each other, directly or around a loop."""

from __future__ import annotations

import sys
from pathlib import Path

import grimp


def import_cycles(package: str) -> list[list[str]]:
    """The import graph's strongly connected components with more than one module."""
    graph = grimp.build_graph(package)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_the_import_graph_has_no_cycle() -> None:
    assert import_cycles("mlxppd") == []


def test_a_cycle_is_found(tmp_path: Path) -> None:
    package = tmp_path / "loopy"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from loopy import b\n")
    (package / "b.py").write_text("from loopy import c\n")
    (package / "c.py").write_text("from loopy import a\n")
    (package / "d.py").write_text("from loopy import a\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert import_cycles("loopy") == [["loopy.a", "loopy.b", "loopy.c"]]
    finally:
        sys.path.remove(str(tmp_path))
