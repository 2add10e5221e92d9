"""No package, test or example reaches into another package's private names.

A sibling package, a test suite, the integration tests, the examples and these tools may use only the public names
of ``swap_core`` and the family packages: an underscore name (a module-level ``_helper``, a method ``_update``, an
attribute ``self._store``) defined in one package's sources and used anywhere outside them is a reach past its
seam, and this check fails naming each one. A file may use an underscore name it defines itself (a test's own
subclass), and ``super()._name(...)`` calls the parent of a class the file defines. Run by ``nox -s lint``; reads
the sources with :mod:`ast` only::

    python tools/check_private_reaches.py
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_SOURCES = {path.parent.name: path.parent / "src" for path in sorted(ROOT.glob("packages/*/pyproject.toml"))}
CONSUMERS = ("packages", "integration-tests", "examples", "tools")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_names(tree: ast.AST) -> set[str]:
    """Underscore names a module defines: module-level and class-level names, methods, ``self._x = ...``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names.add(leaf.id)
                    elif isinstance(leaf, ast.Attribute):
                        names.add(leaf.attr)
    return {name for name in names if _private(name)}


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _owner(path: Path) -> str | None:
    """The package whose sources hold ``path``, or ``None`` (a test, an example, a tool)."""
    for package, source in PACKAGE_SOURCES.items():
        if path.is_relative_to(source):
            return package
    return None


def private_names_by_package() -> dict[str, set[str]]:
    return {
        package: set().union(*(defined_names(_parse(path)) for path in sorted(source.rglob("*.py"))))
        for package, source in PACKAGE_SOURCES.items()
    }


def _modules_of(package: str) -> str:
    return package.replace("-", "_")


def reaches(path: Path, private: dict[str, set[str]]) -> Iterator[str]:
    """``path:line: name`` of each private name of another package that ``path`` uses."""
    tree = _parse(path)
    owner = _owner(path)
    foreign = set().union(*(names for package, names in private.items() if package != owner))
    own = defined_names(tree)
    modules = {_modules_of(package): package for package in private if package != owner}
    where = path.relative_to(ROOT)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            parts = node.module.split(".")
            if parts[0] in modules:
                bad = [part for part in parts[1:] if _private(part)]
                bad += [alias.name for alias in node.names if _private(alias.name)]
                for name in bad:
                    yield f"{where}:{node.lineno}: {name} (from {node.module})"
        elif isinstance(node, ast.Attribute) and node.attr in foreign and node.attr not in own:
            value = node.value
            if isinstance(value, ast.Name) and value.id in {"self", "cls"}:
                continue
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                continue
            yield f"{where}:{node.lineno}: .{node.attr}"


def main() -> int:
    private = private_names_by_package()
    found = [
        reach
        for top in CONSUMERS
        for path in sorted((ROOT / top).rglob("*.py"))
        if ".nox" not in path.parts and "build" not in path.parts
        for reach in reaches(path, private)
    ]
    if found:
        print("Underscore names of another package used outside it (use or add a public name instead):")
        print("\n".join(f"  {reach}" for reach in found))
        return 1
    print(f"no package, test, example or tool uses another package's private names ({len(private)} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
