"""What modules of mlxppd/http share is public: none imports or reaches into another mlxppd
module's private names (``_x``), so an API's route module never leans on another's helpers
(issue 34). Dunder names (``__version__``) are public."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "mlxppd"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_module(package: Path, dotted: str) -> bool:
    """Whether ``dotted`` (``pkg.a.b``) names a module or package under ``package``."""
    path = package.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _source(node: ast.ImportFrom, module: str) -> str:
    """The absolute module a ``from ... import`` reads from (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")[: -node.level]
    return ".".join([*base, *([node.module] if node.module else [])])


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (left := _dotted(node.value)) is not None:
        return f"{left}.{node.attr}"
    return None


def _imports(tree: ast.Module, module: str, package: Path) -> tuple[list[str], dict[str, str]]:
    """The private names ``tree`` imports from the package, and its local names for the
    package's modules (``from pkg.a import b``, ``import pkg.a as m``)."""
    root = package.name
    found: list[str] = []
    modules: dict[str, str] = {root: root}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _source(node, module)
            if source != root and not source.startswith(root + "."):
                continue
            for alias in node.names:
                dotted = f"{source}.{alias.name}"
                if _private(alias.name) or any(_private(p) for p in source.split(".")):
                    found.append(f"{node.lineno} from {source} import {alias.name}")
                elif _is_module(package, dotted):
                    modules[alias.asname or alias.name] = dotted
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != root:
                    continue
                if any(_private(p) for p in alias.name.split(".")):
                    found.append(f"{node.lineno} import {alias.name}")
                elif alias.asname:
                    modules[alias.asname] = alias.name
    return found, modules


def private_uses(folder: Path, package: Path = PACKAGE) -> list[str]:
    """Where a module under ``folder`` imports, or reads as an attribute, a private name of
    another module of ``package``: ``path:line what``."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        tree = ast.parse(path.read_text(), str(path))
        imported, modules = _imports(tree, module, package)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            dotted = _dotted(node.value)
            if dotted is None:
                continue
            head, _, rest = dotted.partition(".")
            target = ".".join(p for p in (modules.get(head), rest) if p)
            if head in modules and _is_module(package, target):
                imported.append(f"{node.lineno} {dotted}.{node.attr}")
        where = path.relative_to(package.parent)
        found += [f"{where}:{line}" for line in imported]
    return found


def test_no_http_module_uses_another_modules_private_names() -> None:
    assert private_uses(PACKAGE / "http") == []


def test_the_check_finds_private_imports_and_reads(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "http").mkdir(parents=True)
    for name in ("__init__.py", "http/__init__.py", "http/b.py", "core.py"):
        (pkg / name).write_text("")
    (pkg / "http" / "a.py").write_text(
        "from pkg import __version__\n"
        "from pkg.http.b import _helper, public\n"
        "from .b import _other\n"
        "from pkg.http import b\n"
        "import pkg.core as core\n"
        "import pkg.http.b\n"
        "import json\n"
        "b._read, core._x, pkg.http.b._y, b.public, json._private, self._mine\n"
    )
    assert private_uses(pkg / "http", pkg) == [
        "pkg/http/a.py:2 from pkg.http.b import _helper",
        "pkg/http/a.py:3 from pkg.http.b import _other",
        "pkg/http/a.py:8 b._read",
        "pkg/http/a.py:8 core._x",
        "pkg/http/a.py:8 pkg.http.b._y",
    ]
