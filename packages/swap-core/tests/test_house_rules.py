"""The house's structural rules, read from the source (issue "The house: one step with its driver chosen once"):
no class over 350 lines nor function over 50 in any package, and the step inside the backward named in code only by
its driver's modules, the config and the public face (docstrings and messages may cite ``SwapConfig(step=...)``)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SOURCES = sorted((ROOT / "packages").glob("*/src/**/*.py"))
SWAP_CORE = ROOT / "packages" / "swap-core" / "src" / "swap_core"

MAX_CLASS_LINES = 350
MAX_FUNCTION_LINES = 50

MODE_NAMES = ("in_backward", "inbackward")
MODE_MAY_BE_NAMED_IN = (
    "optimizer/in_backward/",  # the driver
    "config.py",  # SwapConfig(step="in_backward")
    "optimizer/swap_optimizer.py",  # the public face: it picks the driver of config.step
    "stats.py",  # the public SwapStats.batches_in_backward
    "testing/",  # the public test helpers: pairs stepped through a backward, planted bugs in the driver
)


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def _oversized(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > limit:
                yield f"{_relative(path)}:{node.lineno}: {node.name} has {lines} lines (at most {limit})"


def _identifiers(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every name the code spells: variables, attributes, imports, definitions, arguments, keywords, and strings
    that are a name by themselves (``config.step == "in_backward"``), not text that cites one (a docstring)."""
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names = [node.value]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or "", *(alias.name for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names = [node.name]
        elif isinstance(node, ast.arg | ast.keyword) and node.arg is not None:
            names = [node.arg]
        for name in names:
            yield getattr(node, "lineno", 0), name


def _mode_named(path: Path) -> Iterator[str]:
    for line, name in _identifiers(ast.parse(path.read_text(), str(path))):
        if any(mode in name.lower().replace(".", "_") for mode in MODE_NAMES):
            yield f"{_relative(path)}:{line}: {name}"


def test_no_class_over_350_lines_nor_function_over_50() -> None:
    assert SOURCES, "the packages' sources should be found from the test's path"
    oversized = [finding for path in SOURCES for finding in _oversized(path)]
    assert oversized == [], "split these:\n" + "\n".join(oversized)


def test_the_step_inside_the_backward_is_named_only_by_its_driver_the_config_and_the_public_face() -> None:
    outside = [
        finding
        for path in sorted(SWAP_CORE.rglob("*.py"))
        if not path.relative_to(SWAP_CORE).as_posix().startswith(MODE_MAY_BE_NAMED_IN)
        for finding in _mode_named(path)
    ]
    assert outside == [], "a mode read below the setup; let the driver decide it:\n" + "\n".join(outside)


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("from .in_backward import InBackward\n", ["in_backward", "InBackward"]),
        ("reverse = driver.walks_in_backward_order\n", ["walks_in_backward_order"]),
        ('if config.step == "in_backward":\n    pass\n', ["in_backward"]),
        ('def f():\n    """Only with SwapConfig(step="in_backward")."""\n', []),
        ("raise ValueError(\"refused inside the backward (SwapConfig(step='in_backward'))\")\n", []),
    ],
    ids=["import", "attribute", "mode-compared", "docstring", "message"],
)
def test_the_mode_check_reads_names_not_text(tmp_path: Path, source: str, found: list[str]) -> None:
    """Planted: what the check above must find, and the text it must let be."""
    path = tmp_path / "planted.py"
    path.write_text(source)
    assert [line.split(": ", 1)[1] for line in _mode_named(path)] == found


def test_the_size_check_finds_a_long_function(tmp_path: Path) -> None:
    path = tmp_path / "planted.py"
    path.write_text("def long():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert [finding.split(": ", 1)[1] for finding in _oversized(path)] == ["long has 51 lines (at most 50)"]
