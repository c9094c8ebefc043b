"""The code stays readable: no function in mlxppd/ runs past 80 lines.

Argparse declarations (``register``, ``*_parser``, ``*_flags`` in mlxppd/cli) are exempt: they
are one flag after another, each with its help text, and read best in one place.
"""

from __future__ import annotations

import ast
import builtins
import enum
import importlib
from pathlib import Path
from typing import Any

import pydantic
import pytest

from tests.support.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "mlxppd"
MAX_LINES = 80


def _is_argparse_declaration(path: Path, name: str) -> bool:
    return path.parent.name == "cli" and (
        name == "register" or name.endswith("_parser") or name.endswith("_flags")
    )


def long_functions(package: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_LINES and not _is_argparse_declaration(path, node.name):
                found.append(f"{path.relative_to(package.parent)}:{node.lineno} {node.name}")
    return found


def test_no_function_is_longer_than_80_lines() -> None:
    assert long_functions() == []


def test_the_check_finds_a_long_function_and_spares_argparse(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "pkg" / "cli").mkdir(parents=True)
    (tmp_path / "pkg" / "logic.py").write_text(f"def too_long():\n{body}\n\ndef ok():\n    pass\n")
    (tmp_path / "pkg" / "cli" / "main.py").write_text(f"def register():\n{body}\n")
    assert long_functions(tmp_path / "pkg") == ["pkg/logic.py:1 too_long"]


def constructions(name: str, package: Path = PACKAGE) -> list[str]:
    """Where ``name(...)`` is called in the package (module paths relative to its parent)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == name:
                found.append(str(path.relative_to(package.parent)))
    return found


def test_one_function_starts_a_stage_and_one_a_coordinator() -> None:
    """serve --distributed-config (so the local cluster and a zero-config peer) and the agent
    all start stages and coordinators through mlxppd/runtime/node_start.py."""
    assert constructions("StageWorker") == ["mlxppd/runtime/node_start.py"]
    assert constructions("Coordinator") == ["mlxppd/runtime/node_start.py"]


def class_bases(name: str, package: Path = PACKAGE) -> list[list[str]]:
    """The base classes of each class ``name`` in the package (as written)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.name == name:
                found.append([ast.unparse(base) for base in node.bases])
    return found


def test_the_coordinator_is_a_composition_not_a_stack_of_mixins() -> None:
    """Its parts are members (chain, admission, sender, router, runner), not base classes."""
    assert class_bases("Coordinator") == [[]]


def test_the_runtime_declares_no_host_members_for_mixins() -> None:
    """No ``if TYPE_CHECKING:`` block in mlxppd/runtime declares methods or attributes that
    a class expects its host to provide (a guarded import is fine)."""
    declared = []
    for path in sorted((PACKAGE / "runtime").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                declared += [
                    f"{path.name}:{child.lineno}"
                    for child in node.body
                    if not isinstance(child, ast.Import | ast.ImportFrom)
                ]
    assert declared == []


def test_the_two_phase_layer_move_is_written_once() -> None:
    """Elastic repartition, realignment after a reconnect and every failover path move
    layers through ``StageChain.move`` (mlxppd/runtime/coordinator/chain.py)."""
    assert constructions("Reassign") == ["mlxppd/runtime/coordinator/chain.py"]


def test_the_serving_state_changes_in_one_place() -> None:
    """The coordinator's serving state is assigned only in ``Coordinator._serve``."""
    path = PACKAGE / "runtime" / "coordinator" / "coordinator.py"
    writers = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for child in ast.walk(node):
                if isinstance(child, ast.Assign) and any(
                    ast.unparse(t) == "self.serving" for t in child.targets
                ):
                    writers.append(node.name)
    assert writers == ["__init__", "_serve"]


#: where the parts of one object are composed, never mixed in (docs/architecture.md, runtime)
COMPOSED = ("runtime/stage", "runtime/coordinator")


def _resolve(base: ast.expr, namespace: dict[str, Any]) -> Any:
    """The object a base class expression names in its module (``Generic[T]``: ``Generic``)."""
    if isinstance(base, ast.Subscript):
        return _resolve(base.value, namespace)
    if isinstance(base, ast.Attribute):
        return getattr(_resolve(base.value, namespace), base.attr, None)
    if isinstance(base, ast.Name):  # a module's own names, else a builtin's (Exception)
        return namespace.get(base.id, getattr(builtins, base.id, None))
    return None


def _is_mixin(base: Any, package: str) -> bool:
    """A class of ``package`` other than an exception, an enum, a pydantic model or a Protocol
    (an unresolved name counts too: it cannot be shown to be one of those)."""
    if not isinstance(base, type):
        return base is None
    if base.__module__.split(".")[0] != package:
        return False
    kinds = (BaseException, enum.Enum, pydantic.BaseModel)
    return not issubclass(base, kinds) and not getattr(base, "_is_protocol", False)


def mixed_in(folders: list[Path], root: Path = REPO_ROOT, package: str = "mlxppd") -> list[str]:
    """Each class under ``folders`` deriving from a class of ``package`` that is not an
    exception, enum, pydantic model or Protocol, named with its bases as written."""
    found = []
    for path in sorted(p for folder in folders for p in folder.rglob("*.py")):
        module = importlib.import_module(".".join(path.relative_to(root).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and any(
                _is_mixin(_resolve(base, vars(module)), package) for base in node.bases
            ):
                bases = ", ".join(ast.unparse(base) for base in node.bases)
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}({bases})")
    return found


def test_the_stage_and_the_coordinator_mix_no_classes_in() -> None:
    """Their parts are objects given what they need, not base classes of one host."""
    assert mixed_in([PACKAGE / folder for folder in COMPOSED]) == []


def test_the_mixin_check_spares_errors_enums_models_and_protocols(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "shape_probe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "parts.py").write_text(
        "import enum, typing\nimport pydantic\n\n"
        "class Part: ...\nclass Failure(Exception): ...\nclass Kind(enum.Enum): ...\n"
        "class Model(pydantic.BaseModel): ...\nclass Port(typing.Protocol): ...\n"
    )
    (package / "host.py").write_text(
        "import typing\nfrom shape_probe import parts\nfrom shape_probe.parts import Part\n"
        "T = typing.TypeVar('T')\n"
        "class Host(Part, typing.Generic[T]): ...\n"
        "class Qualified(parts.Part): ...\n"
        "class Error(parts.Failure): ...\nclass Kinds(parts.Kind): ...\n"
        "class Reply(parts.Model): ...\nclass Wider(parts.Port, typing.Protocol): ...\n"
        "class Foreign(dict): ...\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert mixed_in([package], tmp_path, "shape_probe") == [
        "shape_probe/host.py:5 Host(Part, typing.Generic[T])",
        "shape_probe/host.py:6 Qualified(parts.Part)",
    ]
