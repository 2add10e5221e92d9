"""DCP checkpoints of an FSDP2 model with swapped AdamW on 2 gloo ranks (simulated accelerator).

Two process worlds, as in a real restart: the first trains 5 steps, saves
(sync and async), trains 5 more and records the uninterrupted run with
``torch.save``; it also checks interop with plain AdamW, the device bound
of saving, and refused checkpoints. The second world, new processes, loads
the checkpoints and trains the same 5 steps: bitwise the uninterrupted run.
Resharding: the 2-rank checkpoint loads into one unsharded process and into
FSDP2 over 4 ranks with the gathered values of the 2-rank run.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ckpt_training import (
    HIDDEN,
    IN_FEATURES,
    adamw,
    assert_snapshots_equal,
    build_layers,
    check_interop_both_ways,
    full_snapshot,
    gathered,
    local_snapshot,
    shard,
    train,
)

from swap_ckpt import AppState, CheckpointFileError, CheckpointMismatchError, StateInitDivergenceError, load_checkpoint
from swap_core import SwapOptimizer
from swap_core.sim import SimBackend
from swap_core.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.sim_only]

WORLD_SIZE = 2
FIRST, SECOND = 5, 5


def _sim(optimizer: torch.optim.Optimizer) -> SimBackend:
    assert isinstance(optimizer, SwapOptimizer) and isinstance(optimizer.backend, SimBackend)
    return optimizer.backend


def _reference(world_size: int, *, swapped: bool, rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = shard(build_layers(), world_size)
    return model, adamw(model, swapped=swapped, seed=rank)


def _first_world(rank: int, world_size: int, directory: Path) -> None:
    model, optimizer = _reference(world_size, swapped=True, rank=rank)
    train(model, optimizer, 0, FIRST, rank)
    at_save = local_snapshot(model, optimizer)
    _save_within_device_bound(model, optimizer, directory / "swapped", rank)
    # An async save, then steps at once: the checkpoint must still be the state at save time.
    # Its own process group: the background writer's collectives must not interleave with training's.
    checkpoint_group = dist.new_group(backend="gloo")
    app = AppState(model, optimizer)
    pending = dcp.async_save({"app": app}, checkpoint_id=directory / "async", process_group=checkpoint_group)
    assert app.private_host_bytes == 0, "the async save made a copy of its own beside DCP's staging copy"
    train(model, optimizer, FIRST, SECOND, rank)
    pending.result()
    torch.save({"at_save": at_save, "final": local_snapshot(model, optimizer)}, directory / f"expected_{rank}.pt")

    check_interop_both_ways(
        lambda swapped: _reference(world_size, swapped=swapped, rank=rank), rank, directory, at_save, steps=FIRST
    )
    _bad_checkpoints_leave_live_state_untouched(model, optimizer, world_size, rank, directory)
    _ranks_disagreeing_on_the_init_step_fail_together(world_size, rank)


def _save_within_device_bound(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path, rank: int
) -> None:
    sim = _sim(optimizer)
    stats = optimizer.stats  # type: ignore[attr-defined]
    sim.reset_peak_memory_stats()
    app = AppState(model, optimizer)
    dcp.save({"app": app}, checkpoint_id=checkpoint)
    # Saving holds only the (tiny) resident states on the device: nothing swapped comes back.
    assert sim.max_memory_allocated() == stats.resident_state_device_bytes, (rank, sim.max_memory_allocated())
    # And no host copy: DCP read the host mirrors (DTensor aliases of them) in place.
    assert app.private_host_bytes == 0 and sim.max_host_pinned_bytes() == sim.host_pinned_bytes(), rank
    assert 0 < stats.resident_state_device_bytes < stats.peak_state_device_bytes, stats


def _save_variant(world_size: int, rank: int, checkpoint: Path, **variant: Any) -> None:
    """A checkpoint of another model (plain AdamW, one step)."""
    model = shard(build_layers(**variant), world_size)
    optimizer = adamw(model, swapped=False)
    train(model, optimizer, 0, 1, rank)
    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=checkpoint)


def _bad_checkpoints_leave_live_state_untouched(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, world_size: int, rank: int, directory: Path
) -> None:
    _save_variant(world_size, rank, directory / "extra", extra_layer=True)
    _save_variant(world_size, rank, directory / "missing", drop_last=True)
    _save_variant(world_size, rank, directory / "shape", hidden=32)
    if rank == 0:
        _corrupt_copies(directory / "swapped", directory)
    dist.barrier()
    expected_errors: dict[str, tuple[type[BaseException], str]] = {
        "extra": (CheckpointMismatchError, r"holds 8 entries .*: app.model.3.bias, app.model.3.weight"),
        "missing": (RuntimeError, "Missing key in checkpoint state_dict: app.model.2.weight"),
        "shape": (
            ValueError,
            r"Size mismatch between saved torch.Size\(\[32, 16\]\) and current: "
            r"torch.Size\(\[64, 16\]\) for app.model.0.weight",
        ),
        "truncated": (CheckpointFileError, r"Checkpoint file \S+/truncated/__0_0.distcp is truncated"),
        "no_metadata": (CheckpointFileError, r"Checkpoint metadata \S+/no_metadata/\.metadata is missing"),
        "corrupt_metadata": (
            CheckpointFileError,
            r"Checkpoint metadata \S+/corrupt_metadata/\.metadata is unreadable \(truncated or corrupt\?\)",
        ),
    }
    before = local_snapshot(model, optimizer)
    for name, (error, message) in expected_errors.items():
        with pytest.raises(error, match=message):
            load_checkpoint({"app": AppState(model, optimizer)}, directory / name)
        # Every refusal comes before any tensor is read: model and optimizer are bitwise untouched.
        assert_snapshots_equal(before, local_snapshot(model, optimizer), f"rank {rank} after {name!r}")


def _ranks_disagreeing_on_the_init_step_fail_together(world_size: int, rank: int) -> None:
    """A fresh optimizer with a gradient on rank 1 only: torch would step on rank 0 alone.

    A plain optimizer is refused on every rank. A swapped one never takes torch's step: every rank
    creates its states without one, gradients or not, and moves nothing to the device.
    """
    for swapped in (False, True):
        model, optimizer = _reference(world_size, swapped=swapped, rank=rank)
        if rank == 1:
            for param in model.parameters():
                param.grad = torch.zeros_like(param)
        if not swapped:
            with pytest.raises(
                StateInitDivergenceError, match=r"Optimizer 0 \(AdamW\) has no state on ranks \[0\] only"
            ):
                AppState(model, optimizer).state_dict()
            assert not optimizer.state
            continue
        sim = _sim(optimizer)
        sim.reset_copy_stats()
        state = AppState(model, optimizer).state_dict()["optim"]["state"]
        assert sorted(state) == ["0.bias", "0.weight", "2.bias", "2.weight"], sorted(state)
        assert all(entry["step"].item() == 0 for entry in state.values())
        assert sim.copy_stats.h2d_copies == sim.copy_stats.d2h_copies == 0


def _corrupt_copies(checkpoint: Path, directory: Path) -> None:
    truncated = shutil.copytree(checkpoint, directory / "truncated")
    data = truncated / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    no_metadata = shutil.copytree(checkpoint, directory / "no_metadata")
    (no_metadata / ".metadata").unlink()
    corrupt = shutil.copytree(checkpoint, directory / "corrupt_metadata") / ".metadata"
    corrupt.write_bytes(corrupt.read_bytes()[: corrupt.stat().st_size // 2])


def _second_world(rank: int, world_size: int, directory: Path) -> None:
    expected = torch.load(directory / f"expected_{rank}.pt", weights_only=True)
    for checkpoint in ("swapped", "async"):
        model, optimizer = _reference(world_size, swapped=True, rank=rank)
        sim = _sim(optimizer)
        sim.reset_peak_memory_stats()
        dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=directory / checkpoint)
        load_peak = sim.max_memory_allocated()
        assert_snapshots_equal(expected["at_save"], local_snapshot(model, optimizer), f"rank {rank} {checkpoint} load")
        train(model, optimizer, FIRST, SECOND, rank)
        assert_snapshots_equal(expected["final"], local_snapshot(model, optimizer), f"rank {rank} {checkpoint} resume")
        # A fresh optimizer gets its states without torch's init step: loading holds only the tiny resident
        # states on the device (old and new briefly), far below a step's peak.
        stats = optimizer.stats  # type: ignore[attr-defined]
        assert load_peak == 2 * stats.resident_state_device_bytes, (rank, load_peak, stats)
        assert 0 < stats.resident_state_device_bytes < stats.peak_state_device_bytes, stats


def _resharded_to_one_process(directory: Path) -> None:
    """The 2-rank checkpoint loads into an unsharded model in one process: the gathered values."""
    per_rank = [torch.load(directory / f"expected_{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]
    model = build_layers()
    optimizer = adamw(model, swapped=True)
    load_checkpoint({"app": AppState(model, optimizer)}, directory / "swapped")
    at_save = gathered([run["at_save"] for run in per_rank])
    assert at_save["optim"]["state"]["0.weight"]["exp_avg"].shape == (HIDDEN, IN_FEATURES)
    assert_snapshots_equal(at_save, local_snapshot(model, optimizer), "2 -> 1")


def _resharded_to_four_ranks(rank: int, world_size: int, directory: Path) -> None:
    """The 2-rank checkpoint loads into FSDP2 over 4 ranks: the gathered values, each rank its quarter."""
    per_rank = [torch.load(directory / f"expected_{saved}.pt", weights_only=True) for saved in range(WORLD_SIZE)]
    model, optimizer = _reference(world_size, swapped=True, rank=rank)
    load_checkpoint({"app": AppState(model, optimizer)}, directory / "swapped")
    local_state = local_snapshot(model, optimizer)["optim"]["state"]["0.weight"]["exp_avg"]
    assert local_state.shape == (HIDDEN // world_size, IN_FEATURES), local_state.shape
    at_save = gathered([run["at_save"] for run in per_rank])
    assert_snapshots_equal(at_save, full_snapshot(model, optimizer), f"rank {rank} 2 -> {world_size}")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp2_swapped_adamw_checkpoints(tmp_path: Path) -> None:
    run_distributed(_first_world, WORLD_SIZE, tmp_path)
    run_distributed(_second_world, WORLD_SIZE, tmp_path)
    _resharded_to_one_process(tmp_path)
    run_distributed(_resharded_to_four_ranks, 4, tmp_path)
