"""DTensor (FSDP2-style) parameters: swapped local shards, bitwise equal to the plain optimizer on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from swap_core import SwapConfig, swap_optimizer
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal
from swap_core.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.sim_only]

SHAPES = [(64, 20), (30, 16), (48,), (8,)]


def _full_tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _dtensor_parity(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))

    def sharded(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [distribute_tensor(tensor, mesh, [Shard(0)]) for tensor in tensors]

    for packed in (True, False):
        plain_params = [torch.nn.Parameter(t) for t in sharded(_full_tensors(0))]
        swapped_params = [torch.nn.Parameter(t) for t in sharded(_full_tensors(0))]
        options = {"lr": 1e-2, "momentum": 0.5, "centered": True}
        plain = torch.optim.RMSprop(plain_params, **options)  # type: ignore[arg-type]
        config = SwapConfig(backend=SimBackend(mode="random", seed=rank), swap_times=2, min_numel=16, packed=packed)
        swapped = swap_optimizer(torch.optim.RMSprop(swapped_params, **options), config)  # type: ignore[arg-type]
        for step in range(4):
            for params in (plain_params, swapped_params):
                for param, grad in zip(params, sharded(_full_tensors(100 + step)), strict=True):
                    param.grad = grad
            plain.step()
            swapped.step()
        for index, (expected, actual) in enumerate(zip(plain_params, swapped_params, strict=True)):
            assert_bitwise_equal(expected, actual, f"rank {rank} packed={packed} parameter {index}")
        swapped_state = swapped.state_dict()
        assert_state_dicts_equal(plain.state_dict(), swapped_state, f"rank {rank} packed={packed}")
        square_avg = swapped_state["state"][0]["square_avg"]
        assert isinstance(square_avg, DTensor) and square_avg.placements == (Shard(0),)
        assert swapped.stats.h2d_bytes > 0
        # Per rank, host memory holds this rank's shards only: three states of each local shard that is
        # large enough to swap (exact per tensor; packed, up to the 64-byte alignment between states).
        locals_ = [param.to_local() for param in swapped_params]  # type: ignore[attr-defined]
        shard_bytes = [local.numel() * local.element_size() for local in locals_ if local.numel() >= 16]
        host_bytes, needed, states = swapped.stats.host_state_bytes, 3 * sum(shard_bytes), 3 * len(shard_bytes)
        full_bytes = 3 * sum(torch.Size(shape).numel() * 4 for shape in SHAPES)
        assert needed <= host_bytes <= needed + (64 * (states - 1) if packed else 0) < full_bytes, host_bytes
    dist.barrier()


def test_dtensor_local_shards_are_swapped_bitwise() -> None:
    run_distributed(_dtensor_parity, 2)
