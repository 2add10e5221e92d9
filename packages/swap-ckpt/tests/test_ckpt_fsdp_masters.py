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
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_training import (
    FSDP_MASTERS,
    FSDP_MASTERS_IN_BACKWARD,
    HSDP_MASTERS,
    LR,
    Layout,
    adamw,
    backward,
    build_layers,
    resharded_to_more_ranks,
    resharded_to_one_process,
    resume_bitwise,
    shard,
    train,
    train_save_and_record,
)

from swap_ckpt import AppState, load_checkpoint
from swap_core.adapters import local_tensor
from swap_core.master_weights import MASTER_KEY, REMAINDER_KEY, master_of
from swap_core.master_weights.remainder import remainder_nbytes
from swap_core.testing.compare import assert_bitwise_equal
from swap_core.testing.distributed import run_distributed
from swap_core.testing.masters import MasterReference
from swap_core.testing.views import planned_batches, simulator_of

pytestmark = [pytest.mark.distributed, pytest.mark.sim_only]

MIN_NUMEL = 32
"""``adamw``'s threshold: the 16-element bias keeps its states (and master) resident."""


def _bf16_reference(model: torch.nn.Module) -> tuple[torch.nn.Module, MasterReference]:
    """The reference of a masters row over ``model`` (sharded bf16): plain AdamW over fp32 leaf copies of its
    parameters as they are now."""
    reference = MasterReference(
        list(model.parameters()), lambda masters: torch.optim.AdamW(masters, lr=LR, weight_decay=0.1)
    )
    return model, reference


def _reference_step(reference: tuple[torch.nn.Module, MasterReference], step: int, rank: int) -> None:
    """The reference's training step ``step``, on the inputs of the swapped run's."""
    model, optimizer = reference
    backward(model, step, rank, dtype=torch.bfloat16)
    optimizer.step()
    model.zero_grad(set_to_none=True)


def _first_world(rank: int, world_size: int, directory: Path, layout: Layout) -> None:
    reference = _bf16_reference(shard(build_layers().to(torch.bfloat16), world_size, replicas=layout.replicas))

    def beside_the_reference(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        """After each swapped step, the reference's; then parameters, masters and moments bitwise."""
        _reference_step(reference, step, rank)
        params = list(model.parameters())
        reference[1].assert_matches(optimizer, params, f"rank {rank} step {step}")
        # Between steps no master or moment of a swapped parameter is on the device, only the resident ones.
        sim = simulator_of(optimizer)
        for param in params:
            state = optimizer.state[param]
            held = state[REMAINDER_KEY] if REMAINDER_KEY in state else local_tensor(state[MASTER_KEY])
            master = master_of(optimizer, param)  # a bf16 shard's master: its remainder joined with it
            assert master is not None and master.dtype == torch.float32 and master.shape == param.shape
            assert sim.owns(held) == (param.numel() < MIN_NUMEL), (rank, step, tuple(param.shape))
        stats = optimizer.stats  # type: ignore[attr-defined]
        if layout.step == "in_backward":  # the first step, and the first after the load, create or take in states
            assert stats.batches_in_backward == (stats.batches if step > 0 else 0), (rank, step, stats)

    model, optimizer, at_save = train_save_and_record(layout, rank, directory, after_step=beside_the_reference)
    params = list(model.parameters())
    swapped_numels = [local_tensor(param).numel() for param in params if param.numel() >= MIN_NUMEL]
    # exp_avg + exp_avg_sq of each swapped bf16 parameter (8 bytes per element of the local shard) and its master:
    # the bits the shard lacks after the backward (2.125 bytes an element), fp32 inside it (4).
    in_backward = layout.step == "in_backward"
    masters = [4 * numel if in_backward else remainder_nbytes(numel) for numel in swapped_numels]
    stats = optimizer.stats  # type: ignore[attr-defined]
    planned = planned_batches(optimizer)
    state_bytes = sum(state.nbytes for batch in planned for state in batch.states)  # without alignment padding
    assert state_bytes == 8 * sum(swapped_numels) + sum(masters), (state_bytes, masters)
    # The masters travel in the batches with the moments (the in-step peak is swap-adam's exact test).
    batch_bytes = [sum(batch.copy_bytes) for batch in planned]
    assert sum(batch_bytes) == stats.host_state_bytes and stats.h2d_bytes == stats.host_state_bytes, stats
    assert MASTER_KEY in at_save["optim"]["state"]["0.weight"]


def _second_world(rank: int, world_size: int, directory: Path, layout: Layout) -> None:
    resume_bitwise(layout, rank, directory, loader=_dcp_load)
    if layout.replicas == 1:  # shares this world
        _plain_checkpoint_into_masters(rank, world_size, directory)


def _dcp_load(state_dict: dict[str, Any], checkpoint: Path) -> None:
    dcp.load(state_dict, checkpoint_id=checkpoint)


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
            local_tensor(param).float(), local_tensor(master_of(optimizer, param)), f"rank {rank}: {name} master"
        )
        for key in ("exp_avg", "exp_avg_sq"):
            assert local_tensor(state[key]).dtype == torch.float32, f"rank {rank}: {name} {key} kept in fp32"
            expected = local_tensor(plain_state[key]).float()
            assert_bitwise_equal(expected, local_tensor(state[key]), f"rank {rank}: {name} {key}")

    reference_model = shard(build_layers().to(torch.bfloat16), world_size)
    with torch.no_grad():
        for reference_param, param in zip(reference_model.parameters(), params, strict=True):
            local_tensor(reference_param).copy_(local_tensor(param))
    _, reference = _bf16_reference(reference_model)
    reference.optimizer.load_state_dict(plain.state_dict())
    for step in range(2, 4):
        train(loaded_model, optimizer, step, 1, rank, dtype=torch.bfloat16)
        _reference_step((reference_model, reference), step, rank)
        reference.assert_matches(optimizer, params, f"rank {rank} step {step} after the plain checkpoint")


def _resharded_to_four_ranks(rank: int, world_size: int, directory: Path) -> None:
    resharded_to_more_ranks(FSDP_MASTERS, rank, world_size, directory, MASTER_KEY)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp2_bf16_master_weights_train_resume_and_reshard(tmp_path: Path) -> None:
    run_distributed(_first_world, FSDP_MASTERS.world_size, tmp_path, FSDP_MASTERS)
    run_distributed(_second_world, FSDP_MASTERS.world_size, tmp_path, FSDP_MASTERS)
    resharded_to_one_process(FSDP_MASTERS, tmp_path, MASTER_KEY)
    run_distributed(_resharded_to_four_ranks, 4, tmp_path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_hsdp_bf16_master_weights_train_and_resume(tmp_path: Path) -> None:
    """HSDP over a 2 x 2 mesh (2 replicas of 2 shards): the masters are sharded and replicated like the weights."""
    run_distributed(_first_world, HSDP_MASTERS.world_size, tmp_path, HSDP_MASTERS)
    run_distributed(_second_world, HSDP_MASTERS.world_size, tmp_path, HSDP_MASTERS)


def _second_world_resumes(rank: int, world_size: int, directory: Path, layout: Layout) -> None:
    resume_bitwise(layout, rank, directory, loader=_dcp_load)


def test_fsdp2_bf16_master_weights_updated_inside_the_backward_train_and_resume(tmp_path: Path) -> None:
    """The batches update inside the backward, from the hooks FSDP2 runs after each reduce-scatter: bitwise the
    reference after every step, and a DCP checkpoint resumes bitwise in new processes."""
    run_distributed(_first_world, FSDP_MASTERS_IN_BACKWARD.world_size, tmp_path, FSDP_MASTERS_IN_BACKWARD)
    run_distributed(_second_world_resumes, FSDP_MASTERS_IN_BACKWARD.world_size, tmp_path, FSDP_MASTERS_IN_BACKWARD)
