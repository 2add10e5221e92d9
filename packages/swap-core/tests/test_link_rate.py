"""``opt.stats.link_bytes_per_second``: the bytes a step's copies moved, both directions, over its transfer window.

On the simulator's virtual clock it is exact (modeled bytes over modeled seconds), so it is checked against the
pipeline's own arithmetic; elsewhere it comes from a traced step's timing events, and is ``None`` untraced. These are
modeled times and counted bytes, never wall-clock timings.
"""

from __future__ import annotations

import pytest
import torch

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.sim import LinkModel, SimBackend
from swap_core.stats import traced_link_bytes_per_second

pytestmark = pytest.mark.sim_only

GBPS = 10.0
LINK = LinkModel(h2d_gbps=GBPS, d2h_gbps=GBPS, device_gbps=1e9, launch_us=0.0)
"""A full-duplex link of 10 GB/s each way, a device whose updates take no time to speak of, and free launches: a
step's transfer window is its copies alone."""
NUMEL = 1 << 16


def _stepped(backend: SimBackend, *, swap_times: int, steps: int = 2, **config: object) -> SwapOptimizer:
    """RMSprop (one state per parameter) over four equal fp32 parameters, swapped, after ``steps`` steps."""
    params = [torch.nn.Parameter(torch.randn(NUMEL, generator=torch.Generator().manual_seed(i))) for i in range(4)]
    optimizer = swap_optimizer(
        torch.optim.RMSprop(params, lr=1e-3), SwapConfig(backend=backend, swap_times=swap_times, **config)
    )
    for _ in range(steps):
        for param in params:
            param.grad = torch.ones_like(param)
        backend.synchronize()  # the device idle at entry: the window is this step's own
        optimizer.step()
    return optimizer


def _clocked() -> SimBackend:
    return SimBackend(mode="lazy", seed=1, check_races=False, poison=False, timing=LINK)


@pytest.mark.parametrize("swap_times", [1, 2, 4])
def test_on_the_clock_it_is_the_steps_bytes_over_its_modeled_transfer_window(swap_times: int) -> None:
    stats = _stepped(_clocked(), swap_times=swap_times).stats
    moved = stats.h2d_bytes + stats.d2h_bytes
    assert stats.h2d_bytes == stats.d2h_bytes == 4 * NUMEL * 4  # every square_avg in and out once
    assert stats.modeled_transfer_seconds is not None
    assert stats.link_bytes_per_second == moved / stats.modeled_transfer_seconds
    # k equal batches of S/k: batch 0's copy-in alone, k - 1 copy-ins each beside the copy-out of the batch before,
    # the last copy-out alone: (k + 1) S/(k B) seconds for 2 S bytes, so 2 k/(k + 1) x one direction's bandwidth.
    expected = 2 * swap_times / (swap_times + 1) * GBPS * 1e9
    assert stats.link_bytes_per_second == pytest.approx(expected, rel=1e-6)


def test_a_traced_step_on_the_clock_gives_the_same_figure_from_its_trace() -> None:
    optimizer = _stepped(_clocked(), swap_times=4, trace=True)
    stats, trace = optimizer.stats, optimizer.trace
    assert trace is not None and stats.modeled_transfer_seconds is not None
    assert sum(interval.nbytes for interval in trace if interval.phase in ("h2d", "d2h")) == (
        stats.h2d_bytes + stats.d2h_bytes
    )
    assert traced_link_bytes_per_second(trace) == stats.link_bytes_per_second
    assert stats.link_bytes_per_second == (stats.h2d_bytes + stats.d2h_bytes) / stats.modeled_transfer_seconds


def test_a_prefetched_copy_in_counts_in_the_bytes_and_in_the_window() -> None:
    backend = _clocked()
    optimizer = _stepped(backend, swap_times=4)
    optimizer.prefetch()
    for param in optimizer.param_groups[0]["params"]:
        param.grad = torch.ones_like(param)
    optimizer.step()
    stats = optimizer.stats
    assert stats.h2d_bytes == 4 * NUMEL * 4  # the prefetched batch 0 is counted in the step it serves
    assert stats.modeled_transfer_seconds is not None
    assert stats.link_bytes_per_second == (stats.h2d_bytes + stats.d2h_bytes) / stats.modeled_transfer_seconds
    assert stats.link_bytes_per_second == pytest.approx(2 * 4 / 5 * GBPS * 1e9, rel=1e-6)


def test_inside_the_backward_it_covers_the_copies_the_hooks_issued() -> None:
    backend = _clocked()
    weights = [torch.nn.Parameter(torch.randn(NUMEL, generator=torch.Generator().manual_seed(i))) for i in range(4)]
    config = SwapConfig(backend=backend, swap_times=2, step="in_backward")
    optimizer = swap_optimizer(torch.optim.RMSprop(weights, lr=1e-3), config)
    for _ in range(3):  # the first step creates the states after the backward; the others run inside it
        backend.synchronize()
        sum((weight * 1.5).sum() for weight in weights).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    stats = optimizer.stats
    assert stats.batches_in_backward == 2 and stats.h2d_bytes == 4 * NUMEL * 4
    assert stats.modeled_transfer_seconds is not None
    assert stats.link_bytes_per_second == (stats.h2d_bytes + stats.d2h_bytes) / stats.modeled_transfer_seconds


def test_without_a_clock_only_a_traced_step_has_one() -> None:
    untraced = _stepped(SimBackend(mode="sync"), swap_times=2)
    assert untraced.stats.h2d_bytes > 0 and untraced.stats.link_bytes_per_second is None
    traced = _stepped(SimBackend(mode="sync"), swap_times=2, trace=True)
    assert traced.trace is not None
    copies = [interval for interval in traced.trace if interval.phase in ("h2d", "d2h")]
    window = max(interval.end for interval in copies) - min(interval.start for interval in copies)
    assert sum(interval.nbytes for interval in copies) == traced.stats.h2d_bytes + traced.stats.d2h_bytes
    assert traced.stats.link_bytes_per_second == (traced.stats.h2d_bytes + traced.stats.d2h_bytes) / window


def test_a_step_that_copies_nothing_has_none() -> None:
    """Every state resident (``offload_fraction=0``): no copy, no window, no rate, on the clock too."""
    stats = _stepped(_clocked(), swap_times=2, offload_fraction=0.0).stats
    assert stats.h2d_bytes == stats.d2h_bytes == 0
    assert stats.modeled_transfer_seconds == 0.0 and stats.link_bytes_per_second is None
