"""Every public name of every package has a docstring: the API reference (docs/api/) is generated from them.

Run by ``nox -s docs`` before the strict mkdocs build. Reads the sources statically with griffe (what
mkdocstrings reads), so it needs no torch::

    python tools/check_api_docs.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {path.parent.name.replace("-", "_"): path.parent / "src" for path in ROOT.glob("packages/*/pyproject.toml")}


def undocumented() -> list[str]:
    """``package.name`` of each public name (in ``__all__``) without a docstring of its own."""
    missing: list[str] = []
    for module_name, source in sorted(PACKAGES.items()):
        module = griffe.load(module_name, search_paths=[str(source)])
        for export in module.exports or []:
            name = export if isinstance(export, str) else export.name  # griffe may keep an expression
            if name.startswith("__"):
                continue
            member = module[name]
            target = member.final_target if member.is_alias else member
            if not target.docstring or not target.docstring.value.strip():
                missing.append(f"{module_name}.{name}")
    return missing


def main() -> int:
    missing = undocumented()
    for name in missing:
        print(f"no docstring: {name}", file=sys.stderr)
    if not missing:
        print(f"every public name of {', '.join(sorted(PACKAGES))} has a docstring")
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
