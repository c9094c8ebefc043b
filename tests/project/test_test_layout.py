"""The tests are laid out like the package, and share code only through tests/support/.

A test module (``test_*.py``) is never imported by another module under tests/, nor by the
Python code a test hands a child process: what two tests share lives in ``tests/support/`` (or,
for a pytest fixture, in the nearest ``conftest.py``). Importing a test module runs its
module-level code in the importer, and ties one test file's contents to another's: moving or
trimming one test file breaks an unrelated one.

Every folder under tests/ mirrors a package of mlxppd/ (``tests/runtime/stage/`` holds the
tests of ``mlxppd/runtime/stage/``), except these four, which test no one package:

- ``tests/support/``: the helpers, fixtures' builders and tiny cases the tests share;
- ``tests/adversarial/``: attacks on the running server across the layers (HTTP floods, a
  stage port under a connection flood), as an attacker sees them;
- ``tests/clients/``: the real client packages (SDKs, frameworks) against a live cluster, as
  their users drive it;
- ``tests/project/``: checks of the repository itself (docs, import graph, code shape, this
  layout).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.paths import REPO_ROOT

TESTS = REPO_ROOT / "tests"
PACKAGE = REPO_ROOT / "mlxppd"
#: folders directly under tests/ that mirror no package (see the module docstring)
NOT_MIRRORED = {"support", "adversarial", "clients", "project"}
#: an import statement inside a string (code a test runs in a child ``python -c``)
CODE_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\s+([\w, ]+)|import\s+([\w.]+))", re.M)


def imported_modules(path: Path, root: Path) -> set[str]:
    """Every module ``path`` imports (anywhere in it, functions and code in strings included),
    as dotted names; ``from pkg import name`` counts as ``pkg`` and ``pkg.name`` (a module)."""
    package = list(path.relative_to(root.parent).with_suffix("").parts)[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for source, names, plain in CODE_IMPORT.findall(node.value):
                found.add(source or plain)
                found.update(f"{source}.{name.strip()}" for name in names.split(",") if source)
    return found


def imports_of_test_modules(root: Path = TESTS) -> list[str]:
    """``file: module`` for each ``test_*`` module of ``root`` that a file under it imports."""
    found = []
    for path in sorted(root.rglob("*.py")):
        modules = set()
        for name in imported_modules(path, root):
            parts = name.split(".")
            if parts[0] != root.name:
                continue
            tests = [i for i, part in enumerate(parts) if part.startswith("test_")]
            if tests:
                modules.add(".".join(parts[: tests[0] + 1]))
        found += [f"{path.relative_to(root.parent)}: {m}" for m in sorted(modules)]
    return found


def unmirrored_folders(root: Path = TESTS, package: Path = PACKAGE) -> list[str]:
    """Folders under ``root`` with no package at the same place under ``package``."""
    found = []
    for folder in sorted(p for p in root.rglob("*") if p.is_dir()):
        relative = folder.relative_to(root)
        if relative.parts[0] in NOT_MIRRORED or "__pycache__" in relative.parts:
            continue
        if any(part.startswith(".") for part in relative.parts):
            continue
        if not (package / relative / "__init__.py").is_file():
            found.append(f"{root.name}/{relative.as_posix()}/")
    return found


def test_no_module_under_tests_imports_a_test_module() -> None:
    assert imports_of_test_modules() == []


def test_every_folder_under_tests_mirrors_a_package() -> None:
    assert unmirrored_folders() == []


def test_the_checks_find_a_test_module_import_and_a_folder_with_no_package(
    tmp_path: Path,
) -> None:
    tests, package = tmp_path / "tests", tmp_path / "pkg"
    for folder in (tests / "core", tests / "support", tests / "stray", package / "core"):
        folder.mkdir(parents=True)
    (package / "core" / "__init__.py").write_text("")
    files = {  # "PKG" stands for "tests": the strings here must not match this file's own check
        "support/helpers.py": "import json\n",
        "core/test_a.py": "from PKG.support.helpers import x\n"
        "def test_x():\n    from PKG.core.test_b import y\n",
        "core/test_c.py": "from . import test_a\nfrom .test_b import z\n",
        "core/test_d.py": 'CHILD = """\nimport os\nfrom PKG.core.test_c import w\n"""\n',
    }
    for name, text in files.items():
        (tests / name).write_text(text.replace("PKG", tests.name))
    assert imports_of_test_modules(tests) == [
        "tests/core/test_a.py: tests.core.test_b",
        "tests/core/test_c.py: tests.core.test_a",
        "tests/core/test_c.py: tests.core.test_b",
        "tests/core/test_d.py: tests.core.test_c",
    ]
    assert unmirrored_folders(tests, package) == ["tests/stray/"]
