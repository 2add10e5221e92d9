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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ckpt_training import (
    FSDP,
    adamw,
    assert_snapshots_equal,
    build_layers,
    check_interop_both_ways,
    local_snapshot,
    resharded_to_more_ranks,
    resharded_to_one_process,
    resume_bitwise,
    shard,
    train,
    train_save_and_record,
)

from swap_ckpt import AppState, CheckpointFileError, CheckpointMismatchError, StateInitDivergenceError, load_checkpoint
from swap_core import SwapOptimizer
from swap_core.sim import SimBackend
from swap_core.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.sim_only]


def _sim(optimizer: torch.optim.Optimizer) -> SimBackend:
    assert isinstance(optimizer, SwapOptimizer) and isinstance(optimizer.backend, SimBackend)
    return optimizer.backend


def _first_world(rank: int, world_size: int, directory: Path) -> None:
    def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path) -> Callable[[], None]:
        _save_within_device_bound(model, optimizer, checkpoint, rank)
        # An async save, then steps at once: the checkpoint must still be the state at save time.
        # Its own process group: the background writer's collectives must not interleave with training's.
        checkpoint_group = dist.new_group(backend="gloo")
        app = AppState(model, optimizer)
        pending = dcp.async_save({"app": app}, checkpoint_id=directory / "async", process_group=checkpoint_group)
        assert app.private_host_bytes == 0, "the async save made a copy of its own beside DCP's staging copy"

        def finish() -> None:
            pending.result()

        return finish

    model, optimizer, at_save = train_save_and_record(FSDP, rank, directory, save=save)
    check_interop_both_ways(FSDP, rank, directory, at_save)
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
        model, optimizer = FSDP.build(rank, swapped=swapped)
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
    for checkpoint in ("swapped", "async"):
        _, optimizer = resume_bitwise(FSDP, rank, directory, checkpoint=checkpoint, loader=_load_measured)
        # A fresh optimizer gets its states without torch's init step: loading holds only the tiny resident
        # states on the device (old and new briefly), far below a step's peak.
        stats = optimizer.stats  # type: ignore[attr-defined]
        load_peak = _LOAD_PEAKS.pop()
        assert load_peak == 2 * stats.resident_state_device_bytes, (rank, load_peak, stats)
        assert 0 < stats.resident_state_device_bytes < stats.peak_state_device_bytes, stats


_LOAD_PEAKS: list[int] = []
"""The device peak of each :func:`_load_measured` of this process."""


def _load_measured(state_dict: dict[str, Any], checkpoint: Path) -> None:
    """``dcp.load``, its device peak noted in :data:`_LOAD_PEAKS`."""
    (optimizer,) = state_dict["app"].optimizers
    sim = _sim(optimizer)
    sim.reset_peak_memory_stats()
    dcp.load(state_dict, checkpoint_id=checkpoint)
    _LOAD_PEAKS.append(sim.max_memory_allocated())


def _resharded_to_four_ranks(rank: int, world_size: int, directory: Path) -> None:
    """The 2-rank checkpoint loads into FSDP2 over 4 ranks: the gathered values, each rank its quarter."""
    resharded_to_more_ranks(FSDP, rank, world_size, directory, "exp_avg")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp2_swapped_adamw_checkpoints(tmp_path: Path) -> None:
    run_distributed(_first_world, FSDP.world_size, tmp_path)
    run_distributed(_second_world, FSDP.world_size, tmp_path)
    resharded_to_one_process(FSDP, tmp_path, "exp_avg")
    run_distributed(_resharded_to_four_ranks, 4, tmp_path)
