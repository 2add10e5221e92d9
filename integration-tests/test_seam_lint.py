"""The seam lint (tools/check_private_reaches.py, run by ``nox -s lint``) catches the reaches it is for: a private
name reached by its string (``monkeypatch.setattr``, ``mock.patch.object``) and an import of swap-core's inner rooms
from another package. Each planted in a file of a scratch tree laid out as this repository."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]

PLANTED = """\
from unittest import mock

from swap_core.optimizer.in_backward import driver
from swap_core.runtime.staging import ArenaStaging


def test_planted(monkeypatch):
    monkeypatch.setattr(driver, "_ready", lambda final, params: False)
    monkeypatch.setattr("swap_core.optimizer.in_backward.driver._ready", None)
    with mock.patch.object(ArenaStaging, "_buffers", 3):
        pass
    monkeypatch.setattr(driver, "_own_helper", None)


def _own_helper():
    pass
"""


def _lint() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_private_reaches", ROOT / "tools" / "check_private_reaches.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_private_names_reached_by_string_and_inner_rooms_imported_are_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lint = _lint()
    monkeypatch.setattr(lint, "ROOT", tmp_path)
    planted = tmp_path / "packages" / "swap-bench" / "tests" / "test_planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text(PLANTED)
    where = "packages/swap-bench/tests/test_planted.py"
    private = {"swap-core": {"_ready", "_buffers", "_own_helper"}}
    assert list(lint.reaches(planted, private)) == [
        f"{where}:8: setattr(..., '_ready')",
        f"{where}:9: setattr(..., '_ready')",
        f"{where}:10: object(..., '_buffers')",
    ], "a name the file defines itself (_own_helper) is its own"
    assert [line.split(" (")[0] for line in lint.inner_room_imports(planted)] == [
        f"{where}:3: swap_core.optimizer.in_backward",
        f"{where}:4: swap_core.runtime.staging",
    ]


def test_swap_cores_own_tests_may_import_its_inner_rooms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lint = _lint()
    monkeypatch.setattr(lint, "ROOT", tmp_path)
    own = tmp_path / "packages" / "swap-core" / "tests" / "test_planted.py"
    own.parent.mkdir(parents=True)
    own.write_text(PLANTED)
    assert list(lint.inner_room_imports(own)) == []


def test_this_repository_has_no_reach() -> None:
    assert _lint().main() == 0
