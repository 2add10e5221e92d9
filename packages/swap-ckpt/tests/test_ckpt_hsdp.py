"""DCP checkpoints of an HSDP model with swapped AdamW on 4 gloo ranks (2x2 mesh, simulated accelerator).

The mesh has dimensions ``("replicate", "shard")``: ranks 0-1 and 2-3 each hold
a full copy, sharded in halves. Two process worlds, as in a real restart: the
first trains 5 steps, saves, trains 5 more and records the uninterrupted run
with ``torch.save``; it also checks interop with plain AdamW both ways. The
second world, new processes, loads the checkpoint and trains the same 5 steps:
bitwise the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_training import (
    HIDDEN,
    IN_FEATURES,
    adamw,
    assert_snapshots_equal,
    build_layers,
    check_interop_both_ways,
    local_snapshot,
    shard,
    train,
)

from swap_ckpt import AppState, load_checkpoint
from swap_core.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.sim_only]

WORLD_SIZE = 4
REPLICAS = 2
FIRST, SECOND = 5, 5


def _hsdp(world_size: int, *, swapped: bool, rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = shard(build_layers(), world_size, replicas=REPLICAS)
    return model, adamw(model, swapped=swapped, seed=rank)


def _first_world(rank: int, world_size: int, directory: Path) -> None:
    model, optimizer = _hsdp(world_size, swapped=True, rank=rank)
    train(model, optimizer, 0, FIRST, rank)
    at_save = local_snapshot(model, optimizer)
    # Sharded over the "shard" dimension only: each rank holds half a matrix, as its replica partner does.
    exp_avg = at_save["optim"]["state"]["0.weight"]["exp_avg"]
    assert exp_avg.shape == (HIDDEN // (world_size // REPLICAS), IN_FEATURES), exp_avg.shape
    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=directory / "swapped")
    train(model, optimizer, FIRST, SECOND, rank)
    torch.save({"at_save": at_save, "final": local_snapshot(model, optimizer)}, directory / f"expected_{rank}.pt")

    check_interop_both_ways(
        lambda swapped: _hsdp(world_size, swapped=swapped, rank=rank), rank, directory, at_save, steps=FIRST
    )


def _resume_world(rank: int, world_size: int, directory: Path) -> None:
    expected = torch.load(directory / f"expected_{rank}.pt", weights_only=True)
    model, optimizer = _hsdp(world_size, swapped=True, rank=rank)
    load_checkpoint({"app": AppState(model, optimizer)}, directory / "swapped")
    assert_snapshots_equal(expected["at_save"], local_snapshot(model, optimizer), f"rank {rank} load")
    train(model, optimizer, FIRST, SECOND, rank)
    assert_snapshots_equal(expected["final"], local_snapshot(model, optimizer), f"rank {rank} resume")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_hsdp_swapped_adamw_resume_and_interop(tmp_path: Path) -> None:
    run_distributed(_first_world, WORLD_SIZE, tmp_path)
    _replicas_agree(tmp_path)
    run_distributed(_resume_world, WORLD_SIZE, tmp_path)


def _replicas_agree(directory: Path) -> None:
    """Ranks 0 and 2 (1 and 3) are replicas of one shard: bitwise the same model and optimizer state."""
    shards = WORLD_SIZE // REPLICAS
    for rank in range(shards, WORLD_SIZE):
        replica = torch.load(directory / f"expected_{rank}.pt", weights_only=True)
        original = torch.load(directory / f"expected_{rank - shards}.pt", weights_only=True)
        for moment in ("at_save", "final"):
            assert_snapshots_equal(original[moment], replica[moment], f"rank {rank} vs {rank - shards} {moment}")
