"""FSDP2 over a bf16 model, swapped AdamW with fp32 master weights, DCP checkpoints (gloo ranks, simulated accelerator).

The masters are fp32 copies of the local shards, kept in host memory as optimizer state. The first world
(2 ranks; 4 for HSDP) trains beside the reference, plain AdamW over fp32 leaf copies of the same shards
(:class:`~swap_core.testing.masters.MasterReference`), and checks parameters, masters and moments
bitwise after every step; it saves a DCP checkpoint after ``FIRST`` steps, trains ``SECOND`` more and
records the run. The second world, new processes, loads it and resumes: bitwise the uninterrupted run.
The checkpoint reshards to one unsharded process and to FSDP2 over 4 ranks with the gathered masters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_training import (
    HIDDEN,
    IN_FEATURES,
    LR,
    adamw,
    assert_snapshots_equal,
    backward,
    build_layers,
    full_snapshot,
    gathered,
    local_snapshot,
    shard,
    train,
)

from swap_ckpt import AppState, load_checkpoint
from swap_core import SwapOptimizer
from swap_core.master_weights import MASTER_KEY
from swap_core.runtime import local_tensor
from swap_core.testing.compare import assert_bitwise_equal
from swap_core.testing.distributed import run_distributed
from swap_core.testing.masters import MasterReference
from swap_core.testing.views import planned_batches, simulator_of

pytestmark = [pytest.mark.distributed, pytest.mark.sim_only]

WORLD_SIZE = 2
HSDP_WORLD_SIZE, HSDP_REPLICAS = 4, 2
FIRST, SECOND = 5, 5
MIN_NUMEL = 32
"""``adamw``'s threshold: the 16-element bias keeps its states (and master) resident."""


def _swapped(world_size: int, rank: int, replicas: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = shard(build_layers().to(torch.bfloat16), world_size, replicas=replicas)
    return model, adamw(model, swapped=True, seed=rank, master_weights=True)


def _step_beside_the_reference(
    swapped: tuple[torch.nn.Module, torch.optim.Optimizer],
    reference: tuple[torch.nn.Module, MasterReference],
    step: int,
    rank: int,
) -> None:
    """One training step of the swapped run and of its reference over fp32 masters, on the same inputs."""
    for model, optimizer in (swapped, reference):
        backward(model, step, rank, dtype=torch.bfloat16)
        optimizer.step()
        model.zero_grad(set_to_none=True)


def _first_world(rank: int, world_size: int, directory: Path, replicas: int) -> None:
    model, optimizer = _swapped(world_size, rank, replicas)
    assert isinstance(optimizer, SwapOptimizer)
    reference_model = shard(build_layers().to(torch.bfloat16), world_size, replicas=replicas)
    reference = MasterReference(
        list(reference_model.parameters()),
        lambda masters: torch.optim.AdamW(masters, lr=LR, weight_decay=0.1),
    )
    params = list(model.parameters())
    sim = simulator_of(optimizer)
    at_save = None
    for step in range(FIRST + SECOND):
        _step_beside_the_reference((model, optimizer), (reference_model, reference), step, rank)
        reference.assert_matches(optimizer, params, f"rank {rank} step {step}")
        # Between steps no master or moment of a swapped parameter is on the device, only the resident ones.
        for param in params:
            master = local_tensor(optimizer.state[param][MASTER_KEY])
            assert master.dtype == torch.float32 and master.shape == local_tensor(param).shape
            assert sim.owns(master) == (param.numel() < MIN_NUMEL), (rank, step, tuple(param.shape))
        if step + 1 == FIRST:
            dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=directory / "masters")
            at_save = local_snapshot(model, optimizer)
    swapped_numel = sum(local_tensor(param).numel() for param in params if param.numel() >= MIN_NUMEL)
    # fp32 master + exp_avg + exp_avg_sq of each swapped bf16 parameter: 12 bytes per element of the local shard.
    stats = optimizer.stats
    assert stats.host_state_bytes == 12 * swapped_numel, (stats.host_state_bytes, swapped_numel)
    # The masters travel in the batches with the moments (the in-step peak is swap-adam's exact test).
    batch_bytes = [sum(batch.copy_bytes) for batch in planned_batches(optimizer)]
    assert sum(batch_bytes) == stats.host_state_bytes and stats.h2d_bytes == stats.host_state_bytes, stats
    assert at_save is not None and MASTER_KEY in at_save["optim"]["state"]["0.weight"]
    torch.save({"at_save": at_save, "final": local_snapshot(model, optimizer)}, directory / f"expected_{rank}.pt")


def _second_world(rank: int, world_size: int, directory: Path, replicas: int) -> None:
    expected = torch.load(directory / f"expected_{rank}.pt", weights_only=True)
    model, optimizer = _swapped(world_size, rank, replicas)
    dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=directory / "masters")
    assert_snapshots_equal(expected["at_save"], local_snapshot(model, optimizer), f"rank {rank} load")
    train(model, optimizer, FIRST, SECOND, rank, dtype=torch.bfloat16)
    assert_snapshots_equal(expected["final"], local_snapshot(model, optimizer), f"rank {rank} resume")
    if replicas == 1:  # shares this world
        _plain_checkpoint_into_masters(rank, world_size, directory)


def _plain_checkpoint_into_masters(rank: int, world_size: int, directory: Path) -> None:
    """A DCP checkpoint of bf16 AdamW without master weights loads into master mode: masters from the loaded
    shards, moments kept in fp32, one warning per rank; then it trains bitwise as AdamW over fp32 masters whose
    moments were loaded from that checkpoint (torch's load casts them to the masters' fp32)."""
    model = shard(build_layers().to(torch.bfloat16), world_size)
    plain = adamw(model, swapped=True, seed=rank)
    train(model, plain, 0, 2, rank, dtype=torch.bfloat16)
    dcp.save({"app": AppState(model, plain)}, checkpoint_id=directory / "plain")

    loaded_model = shard(build_layers().to(torch.bfloat16), world_size)
    optimizer = adamw(loaded_model, swapped=True, seed=rank + 5, master_weights=True)
    with pytest.warns(UserWarning, match=r"no 'master_param' for 4 bfloat16/float16 parameter\(s\)"):
        load_checkpoint({"app": AppState(loaded_model, optimizer)}, directory / "plain")
    params = list(loaded_model.parameters())
    for (name, param), plain_param in zip(loaded_model.named_parameters(), model.parameters(), strict=True):
        state, plain_state = optimizer.state[param], plain.state[plain_param]
        assert_bitwise_equal(local_tensor(plain_param), local_tensor(param), f"rank {rank}: {name} loaded")
        assert_bitwise_equal(
            local_tensor(param).float(), local_tensor(state[MASTER_KEY]), f"rank {rank}: {name} master"
        )
        for key in ("exp_avg", "exp_avg_sq"):
            assert local_tensor(state[key]).dtype == torch.float32, f"rank {rank}: {name} {key} kept in fp32"
            expected = local_tensor(plain_state[key]).float()
            assert_bitwise_equal(expected, local_tensor(state[key]), f"rank {rank}: {name} {key}")

    reference_model = shard(build_layers().to(torch.bfloat16), world_size)
    with torch.no_grad():
        for reference_param, param in zip(reference_model.parameters(), params, strict=True):
            local_tensor(reference_param).copy_(local_tensor(param))
    reference = MasterReference(
        list(reference_model.parameters()), lambda masters: torch.optim.AdamW(masters, lr=LR, weight_decay=0.1)
    )
    reference.optimizer.load_state_dict(plain.state_dict())
    for step in range(2, 4):
        _step_beside_the_reference((loaded_model, optimizer), (reference_model, reference), step, rank)
        reference.assert_matches(optimizer, params, f"rank {rank} step {step} after the plain checkpoint")


def _resharded_to_one_process(directory: Path) -> None:
    per_rank = [torch.load(directory / f"expected_{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]
    model = build_layers().to(torch.bfloat16)
    optimizer = adamw(model, swapped=True, master_weights=True)
    load_checkpoint({"app": AppState(model, optimizer)}, directory / "masters")
    at_save = gathered([run["at_save"] for run in per_rank])
    assert at_save["optim"]["state"]["0.weight"][MASTER_KEY].shape == (HIDDEN, IN_FEATURES)
    assert_snapshots_equal(at_save, local_snapshot(model, optimizer), "2 -> 1")


def _resharded_to_four_ranks(rank: int, world_size: int, directory: Path) -> None:
    per_rank = [torch.load(directory / f"expected_{saved}.pt", weights_only=True) for saved in range(WORLD_SIZE)]
    model, optimizer = _swapped(world_size, rank)
    load_checkpoint({"app": AppState(model, optimizer)}, directory / "masters")
    master = local_snapshot(model, optimizer)["optim"]["state"]["0.weight"][MASTER_KEY]
    assert master.shape == (HIDDEN // world_size, IN_FEATURES) and master.dtype == torch.float32, master.shape
    at_save = gathered([run["at_save"] for run in per_rank])
    assert_snapshots_equal(at_save, full_snapshot(model, optimizer), f"rank {rank} 2 -> {world_size}")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp2_bf16_master_weights_train_resume_and_reshard(tmp_path: Path) -> None:
    run_distributed(_first_world, WORLD_SIZE, tmp_path, 1)
    run_distributed(_second_world, WORLD_SIZE, tmp_path, 1)
    _resharded_to_one_process(tmp_path)
    run_distributed(_resharded_to_four_ranks, 4, tmp_path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_hsdp_bf16_master_weights_train_and_resume(tmp_path: Path) -> None:
    """HSDP over a 2 x 2 mesh (2 replicas of 2 shards): the masters are sharded and replicated like the weights."""
    run_distributed(_first_world, HSDP_WORLD_SIZE, tmp_path, HSDP_REPLICAS)
    run_distributed(_second_world, HSDP_WORLD_SIZE, tmp_path, HSDP_REPLICAS)
