"""No package, test or example reaches into another package's private names or swap-core's inner rooms; no package
source outside its ``torch_compat`` fence names a private torch API.

A sibling package, a test suite, the integration tests, the examples and these tools may use only the public names
of ``swap_core`` and the family packages: an underscore name (a module-level ``_helper``, a method ``_update``, an
attribute ``self._store``) defined in one package's sources and used anywhere outside them is a reach past its
seam, and this check fails naming each one. A file may use an underscore name it defines itself (a test's own
subclass), and ``super()._name(...)`` calls the parent of a class the file defines. A name reached by its string
counts too: ``monkeypatch.setattr(obj, "_name", ...)``, ``mock.patch.object(obj, "_name")``, ``getattr(obj,
"_name")``. Nothing outside swap-core's own directory imports ``swap_core.runtime`` or ``swap_core.optimizer``
(its inner rooms: a family uses the adapter API of ``swap_core.adapters``, a test ``swap_core.testing``). A package's
own sources name
torch's private APIs (``torch._C``, ``torch.optim._muon``, ``tensor._version`` through ``torch.x._y``) only in
their ``*compat.py`` modules, each with a test against the torch it was checked on (aten's operator names, such as
``torch.ops.aten._unsafe_view``, are public). Run by ``nox -s lint``; reads the sources with :mod:`ast` only::

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
INNER_ROOMS = ("swap_core.runtime", "swap_core.optimizer")
"""swap-core's modules no other package, test of another package, example or tool imports."""
_BY_STRING = frozenset({"getattr", "hasattr", "setattr", "delattr", "object"})
"""Calls that reach an attribute by a string: the builtins, ``monkeypatch.setattr``, ``mock.patch.object``."""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_names(tree: ast.AST, *, compat: bool = False) -> set[str]:
    """Underscore names a module defines: module-level and class-level names, methods, ``self._x = ...``.

    ``compat``: a torch compat module, whose ``obj._x = ...`` on objects other than its own sets torch's names (what
    torch reads, such as ``_step_supports_amp_scaling``): those are not the package's."""
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
                    elif isinstance(leaf, ast.Attribute) and not (compat and not _on_own_object(leaf)):
                        names.add(leaf.attr)
    return {name for name in names if _private(name)}


def _on_own_object(attribute: ast.Attribute) -> bool:
    """Whether ``attribute`` is ``self._x`` or ``cls._x``."""
    return isinstance(attribute.value, ast.Name) and attribute.value.id in {"self", "cls"}


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
        package: set().union(
            *(
                defined_names(_parse(path), compat=path.name.endswith("compat.py"))
                for path in sorted(source.rglob("*.py"))
            )
        )
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
        if isinstance(node, ast.Call) and _call_name(node) in _BY_STRING:
            for name in _string_args(node):
                if name in foreign and name not in own:
                    yield f"{where}:{node.lineno}: {_call_name(node)}(..., {name!r})"
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


def _call_name(call: ast.Call) -> str:
    """``setattr`` of ``setattr(...)``, ``object`` of ``mock.patch.object(...)``; ``""`` for other callees."""
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _string_args(call: ast.Call) -> Iterator[str]:
    """The string constants among ``call``'s arguments, and the last part of a dotted one
    (``monkeypatch.setattr("pkg.module._name", value)``)."""
    for arg in call.args:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            yield arg.value.rsplit(".", 1)[-1]


def inner_room_imports(path: Path) -> Iterator[str]:
    """``path:line: module`` of each import of swap-core's inner rooms (:data:`INNER_ROOMS`) outside swap-core."""
    if path.is_relative_to(ROOT / "packages" / "swap-core"):
        return
    where = path.relative_to(ROOT)
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            imported = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            imported = [alias.name for alias in node.names]
        else:
            continue
        for module in imported:
            if any(module == room or module.startswith(room + ".") for room in INNER_ROOMS):
                yield f"{where}:{node.lineno}: {module} (swap-core's inner room; use swap_core.adapters or .testing)"
                break


def _dotted(node: ast.expr) -> list[str] | None:
    """``torch.a.b`` as ``["torch", "a", "b"]``; ``None`` for anything but names and attributes."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _torch_private(parts: list[str]) -> bool:
    """Whether a dotted path into torch names a private part (aten's operators excepted)."""
    if parts[:1] != ["torch"] or parts[:3] == ["torch", "ops", "aten"]:
        return False
    return any(_private(part) for part in parts[1:])


_BY_NAME = frozenset({"getattr", "hasattr", "setattr", "delattr"})


def torch_reaches(path: Path, swaps_own: set[str]) -> Iterator[str]:
    """``path:line: name`` of each private torch API a package source outside a compat module names: through
    ``torch.x._y``, an import, or by name (``getattr(optimizer, "_step_supports_amp_scaling")``; underscore names
    of swap's own, ``swaps_own``, excepted)."""
    where = path.relative_to(ROOT)
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _BY_NAME:
            name = node.args[1] if len(node.args) > 1 else None
            named = name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else ""
            if _private(named) and named not in swaps_own:
                yield f"{where}:{node.lineno}: {node.func.id}(..., {named!r})"
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            parts = node.module.split(".")
            names = [*parts, *(alias.name for alias in node.names)]
            if parts[0] == "torch" and any(_private(part) for part in names[1:]):
                yield f"{where}:{node.lineno}: {node.module} ({', '.join(alias.name for alias in node.names)})"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _torch_private(alias.name.split(".")):
                    yield f"{where}:{node.lineno}: import {alias.name}"
        elif isinstance(node, ast.Attribute):
            parts = _dotted(node)
            if parts is not None and _torch_private(parts):
                yield f"{where}:{node.lineno}: {'.'.join(parts)}"


def main() -> int:
    private = private_names_by_package()
    consumers = [
        path
        for top in CONSUMERS
        for path in sorted((ROOT / top).rglob("*.py"))
        if ".nox" not in path.parts and "build" not in path.parts
    ]
    found = [reach for path in consumers for reach in (*reaches(path, private), *inner_room_imports(path))]
    # Swap's own underscore names, not those its compat modules set on torch's objects.
    swaps_own = set().union(
        *(
            defined_names(_parse(path))
            for source in PACKAGE_SOURCES.values()
            for path in source.rglob("*.py")
            if not path.name.endswith("compat.py")
        )
    )
    found += sorted(
        {
            reach
            for source in PACKAGE_SOURCES.values()
            for path in sorted(source.rglob("*.py"))
            if not path.name.endswith("compat.py")
            for reach in torch_reaches(path, swaps_own)
        }
    )
    if found:
        print(
            "Underscore names of another package used outside it, swap-core's inner rooms imported outside it, or "
            "private torch APIs outside a compat module (use or add a public name, or fence the torch API in the "
            "package's torch_compat):"
        )
        print("\n".join(f"  {reach}" for reach in found))
        return 1
    print(
        f"no package, test, example or tool uses another package's private names or swap-core's inner rooms, and "
        f"no package source outside its compat module a private torch API ({len(private)} packages)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
