"""DCP checkpoints of an HSDP model with swapped AdamW on 4 gloo ranks (2x2 mesh, simulated accelerator).

The mesh has dimensions ``("replicate", "shard")``: ranks 0-1 and 2-3 each hold
a full copy, sharded in halves. Two process worlds, as in a real restart: the
first trains, saves, trains more and records the uninterrupted run (the
:data:`~ckpt_training.HSDP` row of :func:`~ckpt_training.train_save_and_record`);
it also checks interop with plain AdamW both ways. The second world, new
processes, loads the checkpoint and resumes: bitwise the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_training import (
    HIDDEN,
    HSDP,
    IN_FEATURES,
    assert_snapshots_equal,
    check_interop_both_ways,
    resume_bitwise,
    train_save_and_record,
)

from swap_core.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.sim_only]


def _first_world(rank: int, world_size: int, directory: Path) -> None:
    _, _, at_save = train_save_and_record(HSDP, rank, directory)
    # Sharded over the "shard" dimension only: each rank holds half a matrix, as its replica partner does.
    exp_avg = at_save["optim"]["state"]["0.weight"]["exp_avg"]
    assert exp_avg.shape == (HIDDEN // (world_size // HSDP.replicas), IN_FEATURES), exp_avg.shape
    check_interop_both_ways(HSDP, rank, directory, at_save)


def _resume_world(rank: int, world_size: int, directory: Path) -> None:
    resume_bitwise(HSDP, rank, directory)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_hsdp_swapped_adamw_resume_and_interop(tmp_path: Path) -> None:
    run_distributed(_first_world, HSDP.world_size, tmp_path)
    _replicas_agree(tmp_path)
    run_distributed(_resume_world, HSDP.world_size, tmp_path)


def _replicas_agree(directory: Path) -> None:
    """Ranks 0 and 2 (1 and 3) are replicas of one shard: bitwise the same model and optimizer state."""
    shards = HSDP.world_size // HSDP.replicas
    for rank in range(shards, HSDP.world_size):
        replica = torch.load(directory / f"expected_{rank}.pt", weights_only=True)
        original = torch.load(directory / f"expected_{rank - shards}.pt", weights_only=True)
        for moment in ("at_save", "final"):
            assert_snapshots_equal(original[moment], replica[moment], f"rank {rank} vs {rank - shards} {moment}")
