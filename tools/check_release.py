"""Check the built wheels of the monorepo against the sources they came from.

For every package under ``packages/``, with its wheel in ``DIST``::

    python tools/check_release.py DIST

- its version (``src/<pkg>/__about__.py``) is the top entry of its CHANGELOG: the newest
  ``## [X.Y.Z]`` heading, or, while ``## [Unreleased]`` leads, the release it announces
  ("The first release, X.Y.Z." or "Next release: X.Y.Z.");
- the wheel is named for that version; every distribution its modules import at module level is
  in its ``Requires-Dist`` (or in an extra's), and every one it requires outside extras is imported
  somewhere, so an install from the wheel alone works and pulls nothing it does not use;
- every pin on a sibling package (``swap-core>=0.1,<0.2``), extras included, admits that sibling's
  current version;
- with ``--build-backend SPEC``: its ``build-system.requires`` is exactly ``[SPEC]`` (the noxfile installs
  that one backend to install every package editable without build isolation).

Prints one line per package and exits 1 with every problem listed. Needs ``packaging``.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import zipfile

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PACKAGES_DIR = ROOT / "packages"

_VERSION = re.compile(r'^__version__\s*=\s*"([^"]+)"', re.MULTILINE)
_HEADING = re.compile(r"^## \[([^\]]+)\]", re.MULTILINE)
_ANNOUNCED = re.compile(r"(?:The first release|Next release),?\s*:?\s*v?(\d+\.\d+\.\d+\S*?)\.?\s*$", re.MULTILINE)


def source_version(package_dir: Path) -> Version:
    (about,) = package_dir.glob("src/*/__about__.py")
    match = _VERSION.search(about.read_text())
    if match is None:
        raise SystemExit(f'{about}: no __version__ = "..." line')
    return Version(match.group(1))


def changelog_version(changelog: Path) -> Version | None:
    """The version the CHANGELOG's top entry is (or announces, under [Unreleased])."""
    text = changelog.read_text()
    headings = list(_HEADING.finditer(text))
    if not headings:
        return None
    if headings[0].group(1).lower() != "unreleased":
        return Version(headings[0].group(1))
    section_end = headings[1].start() if len(headings) > 1 else len(text)
    announced = _ANNOUNCED.search(text, headings[0].end(), section_end)
    return Version(announced.group(1)) if announced else None


def imported_distributions(source_dir: Path, own: str) -> tuple[set[str], set[str]]:
    """(imported at module level, imported only inside functions) third-party distributions of ``source_dir``.

    An import name maps to its distribution by canonical name (``swap_core`` -> ``swap-core``,
    ``torch`` -> ``torch``); the standard library and the package itself are left out.
    """
    top: set[str] = set()
    lazy: set[str] = set()
    for path in source_dir.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        module_level = set(map(id, tree.body))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                root = name.split(".")[0]
                if root in sys.stdlib_module_names or root == "__future__":
                    continue
                distribution = canonicalize_name(root)
                if distribution == own:
                    continue
                (top if id(node) in module_level else lazy).add(distribution)
    return top, lazy - top


def wheel_metadata(wheel: Path) -> dict[str, list[str]]:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [entry for entry in archive.namelist() if entry.endswith(".dist-info/METADATA")]
        message = Parser().parsestr(archive.read(name).decode())
    return {key: message.get_all(key) or [] for key in ("Name", "Version", "Requires-Dist")}


def check(dist: Path, build_backend: str | None = None) -> list[str]:
    problems: list[str] = []
    package_dirs = sorted(path.parent for path in PACKAGES_DIR.glob("*/pyproject.toml"))
    versions = {canonicalize_name(path.name): source_version(path) for path in package_dirs}
    for package_dir in package_dirs:
        name = canonicalize_name(package_dir.name)
        version = versions[name]
        where = f"{package_dir.name} {version}"
        if build_backend is not None:
            requires = tomllib.loads((package_dir / "pyproject.toml").read_text())["build-system"]["requires"]
            if requires != [build_backend]:
                problems.append(f"{where}: build-system.requires is {requires}, expected [{build_backend!r}]")
        logged = changelog_version(package_dir / "CHANGELOG.md")
        if logged != version:
            problems.append(f"{where}: CHANGELOG.md's top entry is {logged}, not the package version")
        wheels = sorted(dist.rglob(f"{name.replace('-', '_')}-*.whl"))
        if len(wheels) != 1:
            problems.append(f"{where}: expected one wheel in {dist}, found {[wheel.name for wheel in wheels]}")
            continue
        metadata = wheel_metadata(wheels[0])
        if metadata["Version"] != [str(version)]:
            problems.append(f"{where}: the wheel says version {metadata['Version']}")
        requirements = [Requirement(text) for text in metadata["Requires-Dist"]]
        required = {canonicalize_name(req.name) for req in requirements if req.marker is None}
        optional = {canonicalize_name(req.name) for req in requirements if req.marker is not None}
        top, lazy = imported_distributions(package_dir / "src", name)
        # A module-level import an extra provides is fine (e.g. pytest in swap_core.testing, the `testing` extra).
        if top - required - optional:
            missing = sorted(top - required - optional)
            problems.append(f"{where}: imports {missing} at module level but neither requires them nor offers an extra")
        unused = required - top - lazy
        if unused:
            problems.append(f"{where}: requires {sorted(unused)} but never imports them")
        for req in requirements:
            sibling = canonicalize_name(req.name)
            if sibling in versions and not req.specifier.contains(versions[sibling], prereleases=True):
                problems.append(f"{where}: pins {req} but {sibling} is {versions[sibling]}")
        print(f"{where}: wheel {wheels[0].name}, requires {sorted(required)}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("dist", type=Path, help="directory holding the built wheels (searched recursively)")
    parser.add_argument("--build-backend", help="the one build-system requirement every package must declare")
    args = parser.parse_args()
    problems = check(args.dist, args.build_backend)
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
