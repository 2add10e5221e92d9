"""FSDP2 + swapped AdamW, and Muon + AdamW, under torchrun: checkpoint with DCP, stop, resume in new processes.

Cross-package on purpose: swap-core's simulated accelerator, swap-adam's AdamW
and swap-muon's distributed Muon adapters found through the entry point,
swap-ckpt's ``AppState`` and ``load_checkpoint``, launched as a user launches
them (``python -m torch.distributed.run --standalone``, 2 gloo processes on
CPU). The resumed run is bitwise the uninterrupted one. Skipped when swap-adam,
swap-muon or swap-ckpt is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

pytest.importorskip("swap_adam")
pytest.importorskip("swap_ckpt")
pytest.importorskip("swap_muon")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_fsdp_ckpt.py"


def _torchrun(phase: str, directory: Path, optim: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(SCRIPT), "--phase", phase, "--dir", str(directory), "--optim", optim]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, capture_output=True, text=True, timeout=180, env=environment)
    assert completed.returncode == 0, f"phase {phase!r} failed:\n{completed.stdout}\n{completed.stderr}"


@pytest.mark.parametrize(("optim", "optimizers"), [("adamw", 1), ("muon-adamw", 2)])
def test_resume_in_new_processes_matches_the_uninterrupted_run(tmp_path: Path, optim: str, optimizers: int) -> None:
    _torchrun("first", tmp_path, optim)  # steps 0-4 and a checkpoint, then steps 0-9 uninterrupted
    assert (tmp_path / "checkpoint" / ".metadata").is_file()
    _torchrun("resume", tmp_path, optim)

    resumed = torch.load(tmp_path / "resume.pt", weights_only=True)
    uninterrupted = torch.load(tmp_path / "uninterrupted.pt", weights_only=True)
    assert list(resumed["model"]) == list(uninterrupted["model"])
    assert "blocks.1.linear2.weight" in uninterrupted["model"]
    for fqn, parameter in uninterrupted["model"].items():
        assert_bitwise_equal(parameter, resumed["model"][fqn], f"parameter {fqn}")
    assert len(uninterrupted["optim"]) == len(resumed["optim"]) == optimizers
    for index, (expected, actual) in enumerate(zip(uninterrupted["optim"], resumed["optim"], strict=True)):
        assert_state_dicts_equal(expected, actual, f"optimizer {index}")
    last = uninterrupted["optim"][-1]["state"]
    assert int(last["head.weight"]["step"]) == 10  # AdamW always holds the head
    if optim == "muon-adamw":
        momentum = uninterrupted["optim"][0]["state"]["blocks.1.linear2.weight"]["momentum_buffer"]
        assert momentum.shape == (16, 64) and momentum.any()
