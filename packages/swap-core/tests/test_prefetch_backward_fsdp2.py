"""``SwapConfig(prefetch="backward")`` under FSDP2 on 2 gloo ranks: the hooks fire on the sharded parameters after
their reduce-scatter, the prefetch is issued before the backward reaches the first layer, and the result is bitwise
the plain FSDP2 optimizer's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from swap_core import SwapConfig, swap_optimizer
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal
from swap_core.testing.distributed import fsdp2_linears, run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.sim_only]

WIDTH = 16


def _backward(model: torch.nn.Module, step: int, rank: int) -> None:
    inputs = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))
    model(inputs).square().mean().backward()


def _fsdp2_backward_prefetch(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    plain_model, model = fsdp2_linears(mesh, WIDTH), fsdp2_linears(mesh, WIDTH)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    config = SwapConfig(backend=SimBackend(mode="random", seed=rank), swap_times=2, min_numel=16, prefetch="backward")
    swapped = swap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    seen_at_the_first_layer: list[bool] = []
    model[0].weight.register_post_accumulate_grad_hook(lambda _: seen_at_the_first_layer.append(swapped.prefetched))
    for step in range(4):
        for optimizer, net in ((plain, plain_model), (swapped, model)):
            optimizer.zero_grad()
            _backward(net, step, rank)
        plain.step()
        swapped.step()
        swapped.synchronize()
        for index, (expected, actual) in enumerate(zip(plain_model.parameters(), model.parameters(), strict=True)):
            assert_bitwise_equal(expected, actual, f"rank {rank} step {step} parameter {index}")
    assert seen_at_the_first_layer == [False, True, True, True], seen_at_the_first_layer
    dist.barrier()


def test_fsdp2_hooks_issue_the_prefetch_after_the_reduce_scatter_of_the_last_layers() -> None:
    run_distributed(_fsdp2_backward_prefetch, 2)
