"""MetaBackend: the swap pipeline over meta tensors gives the CPU simulator's bytes, copies and virtual times.

The planner (``swap-bench plan``) trusts these numbers for models far larger than this machine, so
here they are compared, field by field, with the same step run on real tensors.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.errors import HostMemoryError
from swap_core.sim import LinkModel, MetaBackend, SimBackend

pytestmark = pytest.mark.sim_only

LINK = LinkModel.preset("pcie4")
SHAPES = [(256, 128), (128,), (512, 64), (1000,), (64, 64), (300, 7)]


def _params(device: str, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    params = []
    for shape in SHAPES:
        values = torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
        param = torch.nn.Parameter(values.to(device) if device == "cpu" else torch.empty_like(values, device=device))
        param.grad = torch.empty_like(param).fill_(0.01) if device == "cpu" else torch.empty_like(param)
        params.append(param)
    return params


def _stepped(
    backend: SimBackend, device: str, dtype: torch.dtype, *, master_weights: bool, packed: bool
) -> SwapOptimizer:
    optimizer = torch.optim.RMSprop(_params(device, dtype), lr=1e-3, momentum=0.9)
    config = SwapConfig(backend=backend, swap_times=3, min_numel=16, packed=packed, master_weights=master_weights)
    swapped = swap_optimizer(optimizer, config)
    swapped.step()
    backend.synchronize()
    swapped.step()
    return swapped


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize(
    ("dtype", "master_weights"), [(torch.float32, False), (torch.bfloat16, True)], ids=["fp32", "bf16_masters"]
)
def test_meta_step_counts_and_times_what_the_cpu_simulator_does(
    packed: bool, dtype: torch.dtype, master_weights: bool
) -> None:
    cpu = SimBackend(mode="sync", check_races=False, poison=False, timing=LINK)
    meta = MetaBackend(LINK)
    on_cpu = _stepped(cpu, "cpu", dtype, master_weights=master_weights, packed=packed)
    on_meta = _stepped(meta, "meta", dtype, master_weights=master_weights, packed=packed)
    # Before the states are read below: reading them waits for the copies, which moves the host's clock.
    assert meta.modeled_times() == cpu.modeled_times()
    assert all(param.is_meta for group in on_meta.param_groups for param in group["params"])
    assert all(value.is_meta for state in on_meta.state.values() for value in state.values() if value.dim() > 0)
    assert on_meta.stats.h2d_bytes > 0
    # Everything but the wall-clock seconds of the step.
    assert on_meta.stats == dataclasses.replace(on_cpu.stats, step_seconds=on_meta.stats.step_seconds)
    assert meta.max_memory_allocated() == cpu.max_memory_allocated()
    assert meta.host_pinned_bytes() == cpu.host_pinned_bytes()
    assert meta.copy_stats == cpu.copy_stats


def test_meta_backend_knows_no_host_limit_unless_given_one() -> None:
    assert MetaBackend().available_host_bytes() is None
    assert MetaBackend().device == torch.device("meta") and MetaBackend().name == "meta"
    small_host = MetaBackend(host_bytes=4096)
    optimizer = torch.optim.RMSprop(_params("meta", torch.float32), lr=1e-3, momentum=0.9)
    with pytest.raises(HostMemoryError, match=r"but the host has .* available\. Nothing was allocated"):
        swapped = swap_optimizer(optimizer, SwapConfig(backend=small_host, min_numel=16))
        swapped.step()
    assert small_host.host_pinned_bytes() == 0


def test_meta_backend_refuses_cpu_tensors_naming_the_device() -> None:
    meta = MetaBackend()
    with pytest.raises(ValueError, match=r"copies meta tensors only, got dst on meta and src on cpu"):
        meta.copy(meta.empty((4,), torch.float32), torch.zeros(4), stream=meta.new_stream())
    assert not meta.owns(torch.zeros(4))
    assert meta.owns(torch.empty(4, device="meta"))


def test_an_optimizer_without_parameters_yet_takes_a_backend_whose_device_is_not_the_cpu() -> None:
    """A backend that does not own CPU memory (meta here, a GPU on a device) is taken by an optimizer whose groups come
    later. The CPU simulator owns CPU tensors, so it could not show the refusal an H200 found; the meta simulator,
    whose device is another one, does."""
    meta = MetaBackend()
    swapped = swap_optimizer(torch.optim.RMSprop([{"params": []}], lr=1e-3), SwapConfig(backend=meta, min_numel=16))
    params = _params("meta", torch.float32)
    swapped.add_param_group({"params": params})
    for param in params:
        param.grad = torch.empty_like(param)
    swapped.step()
    assert swapped.stats.h2d_bytes > 0
