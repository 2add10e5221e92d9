"""Resharding DCP checkpoints of swapped AdamW across layouts: FSDP2 on 2 ranks <-> HSDP on 4 ranks (2x2 mesh).

DCP stores every DTensor shard with its offset in the global tensor and
serves any layout of the same global shape by those offsets. Three process
worlds: FSDP2 trains 3 steps and saves; HSDP loads that checkpoint, then
trains and saves its own; FSDP2 loads the HSDP one. Each side compares the
gathered values (``full_tensor()``) bitwise with those at save time, then takes
one more step, fed the same inputs on every rank: the mean gradient is then
the same over 2 ranks or 4 (sums of equal values and halvings are exact), so
the step is bitwise the saving run's own next step. A layout DCP cannot serve
(a weight stored transposed: same FQN, same element count, another global
shape) is refused naming the FQN, with the live state untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_training import (
    FSDP,
    HSDP,
    adamw,
    assert_snapshots_equal,
    build_layers,
    full_snapshot,
    local_snapshot,
    shard,
    train,
)
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from swap_ckpt import AppState, load_checkpoint
from swap_core.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.sim_only]

STEPS = 3
INPUT_RANK = 0  # the inputs of the step after a load, the same on every rank


def _save_run(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, checkpoint: Path) -> None:
    """Train, save, take the next step: the gathered state at save time and after it, recorded by rank 0."""
    train(model, optimizer, 0, STEPS, rank)
    at_save = full_snapshot(model, optimizer)
    dcp_save({"app": AppState(model, optimizer)}, checkpoint_id=checkpoint)
    train(model, optimizer, STEPS, 1, INPUT_RANK)
    next_step = full_snapshot(model, optimizer)
    if rank == 0:
        torch.save({"at_save": at_save, "next_step": next_step}, checkpoint.with_suffix(".pt"))


def _load_and_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    checkpoint: Path,
    placements: tuple[Placement, ...],
    context: str,
) -> None:
    """Load another layout's checkpoint: its gathered values bitwise, then its next step bitwise."""
    expected = torch.load(checkpoint.with_suffix(".pt"), weights_only=True)
    load_checkpoint({"app": AppState(model, optimizer)}, checkpoint)
    optimizer_state: Any = get_optimizer_state_dict(model, optimizer)["state"]
    exp_avg = optimizer_state["0.weight"]["exp_avg"]
    assert isinstance(exp_avg, DTensor), (context, type(exp_avg))
    assert exp_avg.placements == placements, (context, exp_avg.placements)
    assert_snapshots_equal(expected["at_save"], full_snapshot(model, optimizer), f"{context} load")
    train(model, optimizer, STEPS, 1, INPUT_RANK)
    assert_snapshots_equal(expected["next_step"], full_snapshot(model, optimizer), f"{context} next step")


def _fsdp_saves(rank: int, world_size: int, directory: Path) -> None:
    model, optimizer = FSDP.build(rank)
    _save_run(model, optimizer, rank, directory / "fsdp")
    _save_transposed(world_size, directory / "transposed")


def _save_transposed(world_size: int, checkpoint: Path) -> None:
    """The reference model with its first weight stored ``[in, out]`` (as GPT-2's Conv1D stores a Linear's)."""
    model = build_layers()
    first = model[0]
    assert isinstance(first, torch.nn.Linear)
    first.weight = torch.nn.Parameter(first.weight.detach().t().contiguous())
    model = shard(model, world_size)
    # No step: AppState creates the optimizer state with torch's zero-gradient step.
    dcp_save({"app": AppState(model, adamw(model, swapped=False))}, checkpoint_id=checkpoint)


def _hsdp_loads_and_saves(rank: int, world_size: int, directory: Path) -> None:
    context = f"rank {rank} FSDP2 x{FSDP.world_size} -> HSDP {HSDP.replicas}x{world_size // HSDP.replicas}"
    model, optimizer = HSDP.build(rank)
    _load_and_step(model, optimizer, directory / "fsdp", (Replicate(), Shard(0)), context)
    _transposed_weight_is_refused(model, optimizer, rank, directory / "transposed")

    model, optimizer = HSDP.build(rank)
    _save_run(model, optimizer, rank, directory / "hsdp")


def _transposed_weight_is_refused(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, checkpoint: Path
) -> None:
    before = local_snapshot(model, optimizer)
    message = (
        r"Size mismatch between saved torch.Size\(\[16, 64\]\) and current: "
        r"torch.Size\(\[64, 16\]\) for app.model.0.weight"
    )
    with pytest.raises(ValueError, match=message):
        load_checkpoint({"app": AppState(model, optimizer)}, checkpoint)
    assert_snapshots_equal(before, local_snapshot(model, optimizer), f"rank {rank} after the transposed checkpoint")


def _fsdp_loads(rank: int, world_size: int, directory: Path) -> None:
    context = f"rank {rank} HSDP {HSDP.replicas}x{HSDP.world_size // HSDP.replicas} -> FSDP2 x{world_size}"
    model, optimizer = FSDP.build(rank)
    _load_and_step(model, optimizer, directory / "hsdp", (Shard(0),), context)


def test_fsdp2_and_hsdp_checkpoints_load_into_each_other(tmp_path: Path) -> None:
    run_distributed(_fsdp_saves, FSDP.world_size, tmp_path)
    run_distributed(_hsdp_loads_and_saves, HSDP.world_size, tmp_path)
    run_distributed(_fsdp_loads, FSDP.world_size, tmp_path)
