"""torch's own optimizer math runs unchanged inside a checked compute scope, bitwise and without false races."""

from __future__ import annotations

import pytest
import torch
from torch.optim.adam import adam

from swap_core.sim import SimBackend

pytestmark = pytest.mark.sim_only  # tests of the simulator itself: skipped with --backend cuda|npu

ADAM_OPTIONS = {
    "amsgrad": False,
    "beta1": 0.9,
    "beta2": 0.99,
    "lr": 0.1,
    "weight_decay": 0.01,
    "eps": 1e-8,
    "maximize": False,
}


def _problem() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(64, 16), (33,)]
    params = [torch.randn(shape, generator=generator) for shape in shapes]
    grads = [torch.randn(shape, generator=generator) for shape in shapes]
    exp_avgs = [torch.randn(shape, generator=generator).abs() for shape in shapes]
    exp_avg_sqs = [torch.randn(shape, generator=generator).abs() for shape in shapes]
    return params, grads, exp_avgs, exp_avg_sqs


def _swapped_adam_step(sim: SimBackend, implementation: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefetch Adam's states from host buffers, update on the compute stream, offload, free."""
    params, grads, exp_avgs, exp_avg_sqs = _problem()
    for param in params:
        sim.adopt(param)
    compute, h2d, d2h = sim.compute_stream(), sim.new_stream(), sim.new_stream()
    hosts = []
    for state in exp_avgs + exp_avg_sqs:
        host = sim.empty_host(state.numel(), state.dtype).view(state.shape)
        host.copy_(state)
        hosts.append(host)
    staging = [sim.empty(host.shape, host.dtype) for host in hosts]
    sim.wait_event(h2d, sim.record_event(compute))
    for device, host in zip(staging, hosts, strict=True):
        sim.copy(device, host, stream=h2d)
    sim.wait_event(compute, sim.record_event(h2d))
    steps = [torch.tensor(3.0) for _ in params]  # CPU step counters: plain tensors
    with sim.compute_scope():
        adam(
            params,
            grads,
            staging[:2],
            staging[2:],
            [],
            steps,
            foreach=implementation == "foreach",
            fused=implementation == "fused",
            **ADAM_OPTIONS,  # type: ignore[arg-type]
        )
    sim.wait_event(d2h, sim.record_event(compute))
    for device, host in zip(staging, hosts, strict=True):
        sim.copy(host, device, stream=d2h)
    offloaded = sim.record_event(d2h)
    sim.wait_event(compute, offloaded)
    for device in staging:
        sim.release_storage(device)
    offloaded.synchronize()
    return params, hosts


@pytest.mark.parametrize("implementation", ["single_tensor", "foreach", "fused"])
@pytest.mark.parametrize("mode", ["sync", "lazy", "random"])
def test_adam_under_the_simulator_is_bitwise_identical_and_race_free(implementation: str, mode: str) -> None:
    params, grads, exp_avgs, exp_avg_sqs = _problem()
    steps = [torch.tensor(3.0) for _ in params]
    adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        foreach=implementation == "foreach",
        fused=implementation == "fused",
        **ADAM_OPTIONS,  # type: ignore[arg-type]
    )
    sim = SimBackend(mode=mode, seed=5)  # type: ignore[arg-type]
    swapped_params, hosts = _swapped_adam_step(sim, implementation)
    for expected, got in zip(params + exp_avgs + exp_avg_sqs, swapped_params + hosts, strict=True):
        assert torch.equal(expected, got)
    assert sim.races == []
    assert sim.memory_allocated() == 0
    assert sim.copy_stats.h2d_bytes == sim.copy_stats.d2h_bytes == 2 * (64 * 16 + 33) * 4
