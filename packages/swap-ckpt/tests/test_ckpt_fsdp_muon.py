"""DCP checkpoints of owner-rank distributed Muon + AdamW, swapped, under FSDP2 (2 and 4 ranks) and HSDP (2x2).

Distributed Muon keeps each matrix's full momentum on one owner rank. A
checkpoint holds torch.optim.Muon's layout instead (every rank's shard of
``momentum_buffer``, placed like its parameter), so it reshards like any DCP
checkpoint and loads into plain optimizers. Checked here:

* resume equality in new processes, bitwise, for FSDP2 on 2 ranks and HSDP 2x2;
* the checkpoint's layout (two row chunks per momentum) and the device bound
  of saving and loading (no swapped byte on the device);
* interop with plain torch.optim.Muon + AdamW on the same FSDP2 model, both ways;
* resharding: 2 -> 4 ranks (other owners), 2 -> 1 unsharded process into plain
  torch.optim.Muon + AdamW (interop) and into swapped single-process Muon, FSDP2
  -> HSDP, and a plain single-process checkpoint into the sharded swapped run;
* the flattened layout (``flatten_optimizer_state_dict``) and an async save followed at once by steps
  load the state at save time;
* a malformed momentum on one rank raises on every rank with the state untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_training import (
    HIDDEN,
    IN_FEATURES,
    assert_snapshots_equal,
    build_layers,
    full_snapshot,
    local_snapshot,
    shard,
)
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions

from swap_ckpt import AppState, load_checkpoint
from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.errors import StateDictMismatchError
from swap_core.sim import SimBackend
from swap_core.testing.distributed import run_distributed
from swap_muon import DistributedMuonAdapter, MuonAdapter

pytestmark = [pytest.mark.distributed, pytest.mark.sim_only]

FIRST, SECOND = 3, 2
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
MUON_LR, ADAMW_LR = 2e-2, 1e-2


def _optimizers(model: torch.nn.Module, *, swapped: bool, seed: int = 0) -> list[torch.optim.Optimizer]:
    matrices = [param for param in model.parameters() if param.dim() == 2]
    vectors = [param for param in model.parameters() if param.dim() != 2]
    muon: torch.optim.Optimizer = torch.optim.Muon(matrices, lr=MUON_LR, momentum=0.95)
    adamw: torch.optim.Optimizer = torch.optim.AdamW(vectors, lr=ADAMW_LR, weight_decay=0.1)
    if not swapped:
        return [muon, adamw]
    config = SwapConfig(backend=SimBackend(mode="random", seed=seed), swap_times=2, min_numel=32)
    return [swap_optimizer(muon, config), swap_optimizer(adamw, config)]


def _sharded(
    world_size: int, *, replicas: int = 1, rank: int = 0
) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    model = shard(build_layers(), world_size, replicas=replicas)
    optimizers = _optimizers(model, swapped=True, seed=rank)
    assert isinstance(optimizers[0], SwapOptimizer) and isinstance(optimizers[0].adapter, DistributedMuonAdapter)
    return model, optimizers


def _train(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], first: int, steps: int, rank: int) -> None:
    for step in range(first, first + steps):
        inputs = torch.randn(8, IN_FEATURES, generator=torch.Generator().manual_seed(1000 * step + rank))
        model(inputs).square().mean().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def _local(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    return [local_snapshot(model, optimizer) for optimizer in optimizers]


def _full(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    return [full_snapshot(model, optimizer) for optimizer in optimizers]


def _assert_all_equal(expected: list[dict[str, Any]], actual: list[dict[str, Any]], context: str) -> None:
    for index, (want, got) in enumerate(zip(expected, actual, strict=True)):
        assert_snapshots_equal(want, got, f"{context} optimizer {index}")


def _shared_sim(optimizers: list[torch.optim.Optimizer]) -> tuple[SimBackend, int]:
    """The simulator both optimizers share, and their resident state bytes together."""
    backends, resident = set(), 0
    for optimizer in optimizers:
        assert isinstance(optimizer, SwapOptimizer) and isinstance(optimizer.backend, SimBackend)
        backends.add(optimizer.backend)
        resident += optimizer.stats.resident_state_device_bytes
    assert len(backends) == 1
    return backends.pop(), resident


def _gloo_group() -> Any:
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


# -- FSDP2, 2 ranks ------------------------------------------------------------------
def _fsdp_save_world(rank: int, world_size: int, directory: Path) -> None:
    model, optimizers = _sharded(world_size, rank=rank)
    _train(model, optimizers, 0, FIRST, rank)
    at_save, full_at_save = _local(model, optimizers), _full(model, optimizers)
    sim, resident = _shared_sim(optimizers)
    sim.reset_peak_memory_stats()
    dcp.save({"app": AppState(model, optimizers)}, checkpoint_id=directory / "fsdp")
    # Owners scatter from host mirrors into host buffers: only the (tiny) resident states are on the device.
    assert sim.max_memory_allocated() == resident > 0, (rank, sim.max_memory_allocated(), resident)
    dcp.save({"app": AppState(model, optimizers, options=FLAT)}, checkpoint_id=directory / "fsdp_flat")
    # An async save followed at once by steps: the owners scatter (collectives) while the call stages the state;
    # the writer, on its own process group, reads private host copies that the steps cannot reach.
    pending = dcp.async_save(
        {"app": AppState(model, optimizers)}, checkpoint_id=directory / "fsdp_async", process_group=_gloo_group()
    )
    _train(model, optimizers, FIRST, SECOND, rank)
    pending.result()
    expected = {"at_save": at_save, "full_at_save": full_at_save, "final": _local(model, optimizers)}
    torch.save(expected, directory / f"fsdp_{rank}.pt")
    _malformed_momentum_fails_on_every_rank(optimizers[0], rank)


def _malformed_momentum_fails_on_every_rank(muon: torch.optim.Optimizer, rank: int) -> None:
    before = muon.state_dict()
    broken = muon.state_dict()
    if rank == 1:
        momentum = broken["state"][0]["momentum_buffer"]
        broken["state"][0]["momentum_buffer"] = torch.zeros(momentum.shape[0] + 1, momentum.shape[1])
    with pytest.raises(
        StateDictMismatchError,
        match=r"'momentum_buffer' of parameter 0 on shard rank 1 is shape \(65, 16\), the parameter is \(64, 16\)",
    ):
        muon.load_state_dict(broken)
    for entry, entry_after in zip(before["state"].values(), muon.state_dict()["state"].values(), strict=True):
        assert torch.equal(entry["momentum_buffer"].to_local(), entry_after["momentum_buffer"].to_local())


def _fsdp_resume_world(rank: int, world_size: int, directory: Path) -> None:
    expected = torch.load(directory / f"fsdp_{rank}.pt", weights_only=True)
    model, optimizers = _sharded(world_size, rank=rank)
    sim, _ = _shared_sim(optimizers)
    sim.reset_peak_memory_stats()
    dcp.load({"app": AppState(model, optimizers)}, checkpoint_id=directory / "fsdp")
    load_peak = sim.max_memory_allocated()
    _assert_all_equal(expected["at_save"], _local(model, optimizers), f"rank {rank} load")
    _train(model, optimizers, FIRST, SECOND, rank)
    _assert_all_equal(expected["final"], _local(model, optimizers), f"rank {rank} resume")
    _, resident = _shared_sim(optimizers)
    # States are born on the host and loaded there; old and new resident states briefly coexist.
    assert load_peak == 2 * resident > 0, (rank, load_peak, resident)

    model, optimizers = _sharded(world_size, rank=rank)
    load_checkpoint({"app": AppState(model, optimizers)}, directory / "fsdp_async")
    _assert_all_equal(expected["at_save"], _local(model, optimizers), f"rank {rank} async save load")

    # Flattened: torch's own unflattening would look up only the keys the live state has (none for
    # the matrices a rank does not own); AppState nests by the checkpoint's keys instead.
    model, optimizers = _sharded(world_size, rank=rank)
    load_checkpoint({"app": AppState(model, optimizers, options=FLAT)}, directory / "fsdp_flat")
    _assert_all_equal(expected["at_save"], _local(model, optimizers), f"rank {rank} flattened load")

    # Interop with plain torch.optim.Muon + AdamW on the same FSDP2 model (torch's Muon steps DTensors too; its
    # momentum is a Shard(0) DTensor, the layout the checkpoint holds): each side's checkpoint loads into the other.
    model = shard(build_layers(), world_size)
    plain = _optimizers(model, swapped=False)
    load_checkpoint({"app": AppState(model, plain)}, directory / "fsdp")
    _assert_all_equal(expected["at_save"], _local(model, plain), f"rank {rank} swapped -> plain FSDP2")
    _train(model, plain, FIRST, 1, rank)
    plain_state = _local(model, plain)
    dcp.save({"app": AppState(model, plain)}, checkpoint_id=directory / "plain_fsdp")
    model, optimizers = _sharded(world_size, rank=rank)
    load_checkpoint({"app": AppState(model, optimizers)}, directory / "plain_fsdp")
    _assert_all_equal(plain_state, _local(model, optimizers), f"rank {rank} plain FSDP2 -> swapped")

    # A plain single-process checkpoint (written by the test) loads into the sharded swapped run.
    plain = torch.load(directory / "plain_expected.pt", weights_only=True)
    model, optimizers = _sharded(world_size, rank=rank)
    load_checkpoint({"app": AppState(model, optimizers)}, directory / "plain")
    _assert_all_equal(plain, _full(model, optimizers), f"rank {rank} plain 1 -> swapped {world_size}")
    _train(model, optimizers, 0, 1, rank)


def _checkpoint_has_the_per_shard_layout(directory: Path, world_size: int) -> None:
    metadata = FileSystemReader(directory / "fsdp").read_metadata().state_dict_metadata
    momentum = metadata["app.optim.state.0.weight.momentum_buffer"]
    chunks = sorted((tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in momentum.chunks)  # type: ignore[union-attr]
    rows = HIDDEN // world_size
    assert chunks == [((rank * rows, 0), (rows, IN_FEATURES)) for rank in range(world_size)], chunks


def _plain_single_process(directory: Path, full_at_save: list[dict[str, Any]]) -> None:
    """2 -> 1: the sharded checkpoint into unsharded plain torch optimizers and swapped single-process Muon."""
    for swapped in (False, True):
        model = build_layers()
        optimizers = _optimizers(model, swapped=swapped)
        if swapped:
            assert isinstance(optimizers[0], SwapOptimizer) and isinstance(optimizers[0].adapter, MuonAdapter)
        load_checkpoint({"app": AppState(model, optimizers)}, directory / "fsdp")
        _assert_all_equal(full_at_save, _local(model, optimizers), f"2 -> 1 swapped={swapped}")
    # And a plain single-process checkpoint for the reverse direction.
    model = build_layers()
    optimizers = _optimizers(model, swapped=False)
    _train(model, optimizers, 0, 2, 0)
    dcp.save({"app": AppState(model, optimizers)}, checkpoint_id=directory / "plain")
    torch.save(_local(model, optimizers), directory / "plain_expected.pt")


# -- 4 ranks: FSDP2 with other owners, HSDP 2x2 -----------------------------------------
def _four_rank_world(rank: int, world_size: int, directory: Path) -> None:
    full_at_save = torch.load(directory / "fsdp_0.pt", weights_only=True)["full_at_save"]
    for replicas in (1, 2):
        model, optimizers = _sharded(world_size, replicas=replicas, rank=rank)
        load_checkpoint({"app": AppState(model, optimizers)}, directory / "fsdp")
        _assert_all_equal(full_at_save, _full(model, optimizers), f"rank {rank} FSDP2 2 -> replicas={replicas}")
        _train(model, optimizers, FIRST, 1, rank)

    # HSDP 2x2 saves and resumes (the resume world follows).
    model, optimizers = _sharded(world_size, replicas=2, rank=rank)
    _train(model, optimizers, 0, FIRST, rank)
    at_save = _local(model, optimizers)
    dcp.save({"app": AppState(model, optimizers)}, checkpoint_id=directory / "hsdp")
    _train(model, optimizers, FIRST, SECOND, rank)
    torch.save({"at_save": at_save, "final": _local(model, optimizers)}, directory / f"hsdp_{rank}.pt")


def _hsdp_resume_world(rank: int, world_size: int, directory: Path) -> None:
    expected = torch.load(directory / f"hsdp_{rank}.pt", weights_only=True)
    model, optimizers = _sharded(world_size, replicas=2, rank=rank)
    dcp.load({"app": AppState(model, optimizers)}, checkpoint_id=directory / "hsdp")
    _assert_all_equal(expected["at_save"], _local(model, optimizers), f"rank {rank} HSDP load")
    _train(model, optimizers, FIRST, SECOND, rank)
    _assert_all_equal(expected["final"], _local(model, optimizers), f"rank {rank} HSDP resume")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_distributed_muon_and_adamw_checkpoints(tmp_path: Path) -> None:
    run_distributed(_fsdp_save_world, 2, tmp_path, timeout_s=90)
    _checkpoint_has_the_per_shard_layout(tmp_path, 2)
    _plain_single_process(tmp_path, torch.load(tmp_path / "fsdp_0.pt", weights_only=True)["full_at_save"])
    run_distributed(_fsdp_resume_world, 2, tmp_path, timeout_s=90)
    run_distributed(_four_rank_world, 4, tmp_path, timeout_s=180)
    run_distributed(_hsdp_resume_world, 4, tmp_path, timeout_s=120)
