"""FSDP2 (2 gloo ranks) with owner-rank distributed Muon + AdamW, swapped: resume in new processes, bitwise.

Distributed Muon keeps each matrix's full-size momentum on its owner rank only
(a plain tensor; other ranks hold no state for it). The save works as it is:
each owner writes its full momentum under the FQN. Loading it back is refused
incomplete: the owners' full momentum is not yet redistributed into the
per-shard layout for DCP (and gathered back to owners on load), so after a load
the ranks' Muon states do not match the ones saved. This test is the acceptance
check of that remaining part of issue 5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_training import assert_snapshots_equal, build_layers, local_snapshot, shard

from swap_ckpt import AppState
from swap_core import SwapConfig, swap_optimizer
from swap_core.testing.distributed import DistributedTestError, run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.sim_only]

WORLD_SIZE = 2
FIRST, SECOND = 3, 2


def _muon_adamw(world_size: int) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    model = shard(build_layers(), world_size)
    matrices = [param for param in model.parameters() if param.dim() == 2]
    vectors = [param for param in model.parameters() if param.dim() != 2]
    config = SwapConfig(backend="sim", swap_times=2, min_numel=32)
    muon = swap_optimizer(torch.optim.Muon(matrices, lr=2e-2, momentum=0.95), config)  # DistributedMuonAdapter
    adamw = swap_optimizer(torch.optim.AdamW(vectors, lr=1e-2, weight_decay=0.1), config)
    return model, [muon, adamw]


def _train(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], first: int, steps: int, rank: int) -> None:
    for step in range(first, first + steps):
        inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
        model(inputs).square().mean().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def _snapshots(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    return [local_snapshot(model, optimizer) for optimizer in optimizers]


def _save_world(rank: int, world_size: int, directory: Path) -> None:
    model, optimizers = _muon_adamw(world_size)
    _train(model, optimizers, 0, FIRST, rank)
    at_save = _snapshots(model, optimizers)
    dcp.save({"app": AppState(model, optimizers)}, checkpoint_id=directory / "muon")
    _train(model, optimizers, FIRST, SECOND, rank)
    torch.save({"at_save": at_save, "final": _snapshots(model, optimizers)}, directory / f"muon_{rank}.pt")


def _resume_world(rank: int, world_size: int, directory: Path) -> None:
    expected = torch.load(directory / f"muon_{rank}.pt", weights_only=True)
    model, optimizers = _muon_adamw(world_size)
    dcp.load({"app": AppState(model, optimizers)}, checkpoint_id=directory / "muon")
    for index, snapshot in enumerate(_snapshots(model, optimizers)):
        assert_snapshots_equal(expected["at_save"][index], snapshot, f"rank {rank} optimizer {index} load")
    _train(model, optimizers, FIRST, SECOND, rank)
    for index, snapshot in enumerate(_snapshots(model, optimizers)):
        assert_snapshots_equal(expected["final"][index], snapshot, f"rank {rank} optimizer {index} resume")


@pytest.mark.xfail(
    strict=True,
    raises=DistributedTestError,
    reason=(
        "not implemented yet (issue 5): distributed Muon's owner momentum is saved whole by each owner and not "
        "redistributed to the per-shard DCP layout, so a load does not give every rank back its owned states"
    ),
)
def test_fsdp2_distributed_muon_and_adamw_resume_bitwise(tmp_path: Path) -> None:
    run_distributed(_save_world, WORLD_SIZE, tmp_path, timeout_s=60)
    try:
        run_distributed(_resume_world, WORLD_SIZE, tmp_path, timeout_s=60)
    except DistributedTestError as error:
        # Expected to fail only for the known swap-core reason; anything else is a real failure.
        if "optimizer 0 load: optimizer: state: keys" not in str(error):
            raise RuntimeError(
                f"failed for another reason than the known missing owner redistribution:\n{error}"
            ) from error
        raise
