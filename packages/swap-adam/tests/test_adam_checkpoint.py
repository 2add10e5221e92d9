"""Checkpoints cross process boundaries: swapped <-> plain interop and bitwise-exact resumption.

Every save and every load happens in a fresh interpreter (adam_checkpoint_worker.py,
``torch.save`` / ``torch.load(weights_only=True)``). Runs of 3 steps are saved, resumed
for 2 more steps elsewhere, and compared with an uninterrupted 5-step run computed
here: the parameters and the state dicts must be bitwise equal.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import adam_checkpoint_worker as worker
import pytest
import torch

from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

pytestmark = pytest.mark.sim_only

WORKER = Path(worker.__file__).resolve()
FIRST, SECOND = 3, 2


def _run_worker(*arguments: str) -> None:
    command = [sys.executable, str(WORKER), *arguments]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, f"{' '.join(command)} failed:\n{completed.stdout}\n{completed.stderr}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Runs saved by one process and resumed by another: ``{run name: {variant: checkpoint}}``."""
    directory = tmp_path_factory.mktemp("checkpoints")
    saved, resumed = directory / "saved.pt", directory / "resumed.pt"
    _run_worker("save", "--steps", str(FIRST), str(saved))
    _run_worker("resume", "--first-step", str(FIRST), "--steps", str(SECOND), str(saved), str(resumed))
    return {**torch.load(saved, weights_only=True), **torch.load(resumed, weights_only=True)}


def _uninterrupted(variant: str, steps: int) -> dict[str, Any]:
    params = worker.make_params()
    optimizer = worker.make_optimizer(variant, params, swapped=False)
    worker.train(optimizer, params, 0, steps)
    return worker.checkpoint(params, optimizer)


def _assert_same(expected: dict[str, Any], actual: dict[str, Any], context: str) -> None:
    for index, (want, got) in enumerate(zip(expected["params"], actual["params"], strict=True)):
        assert_bitwise_equal(want, got, f"{context}: parameter {index}")
    assert_state_dicts_equal(expected["optimizer"], actual["optimizer"], context)


@pytest.mark.parametrize("variant", list(worker.VARIANTS))
def test_swapped_state_dict_has_the_plain_format(checkpoints: dict[str, dict[str, Any]], variant: str) -> None:
    _assert_same(checkpoints["plain"][variant], checkpoints["swapped"][variant], f"{variant} after {FIRST}")
    _assert_same(_uninterrupted(variant, FIRST), checkpoints["swapped"][variant], f"{variant} vs in-process")


@pytest.mark.parametrize("resumed", [f"{source}_to_{target}" for source, target in worker.RESUMPTIONS])
@pytest.mark.parametrize("variant", list(worker.VARIANTS))
def test_resumed_run_is_bitwise_the_uninterrupted_run(
    checkpoints: dict[str, dict[str, Any]], variant: str, resumed: str
) -> None:
    _assert_same(_uninterrupted(variant, FIRST + SECOND), checkpoints[resumed][variant], f"{variant} {resumed}")
