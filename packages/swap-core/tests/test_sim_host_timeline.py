"""The host's timeline on the virtual clock: a host that waits needlessly shows in the training loop's time.

A step's own modeled seconds end when its last update ends on the compute stream, whether or not the host
then blocks until the last copy-out has landed. The loop (:func:`swap_core.sim.modeled_iterations`) shows the
difference: the next forward is launched only when ``step()`` returns.
"""

from __future__ import annotations

import pytest
import torch

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.sim import LinkModel, SimBackend, modeled_iterations

pytestmark = pytest.mark.sim_only

LINK = LinkModel(h2d_gbps=20.0, d2h_gbps=20.0, device_gbps=1000.0, launch_us=5.0)
NUMEL = 1 << 18  # 1 MiB of fp32 per parameter: each copy of a batch takes tens of microseconds
FORWARD_BACKWARD = 5e-3


def test_host_blocking_calls_advance_the_host_clock() -> None:
    sim = SimBackend(mode="lazy", timing=LINK)
    device = sim.empty((NUMEL,), torch.float32)
    host = sim.empty_host(NUMEL, torch.float32)
    d2h = sim.new_stream()
    sim.wait_event(d2h, sim.record_event(sim.compute_stream()))
    sim.copy(host, device, stream=d2h)
    copied = sim.record_event(d2h)
    before = sim.modeled_times()
    assert before is not None and before.host < before.transfers
    copied.synchronize()
    after = sim.modeled_times()
    assert after is not None and after.host == pytest.approx(before.transfers), "an event's synchronize waits for it"
    sim.model_compute(1e-3)
    with sim.compute_scope():
        value = device[0].item()  # a value of device memory read by the host
    del value
    read = sim.modeled_times()
    assert read is not None and read.host == pytest.approx(read.compute), ".item() waits for the stream"
    sim.model_compute(1e-3)
    sim.synchronize()
    done = sim.modeled_times()
    assert done is not None and done.host == pytest.approx(max(done.compute, done.transfers))


def test_a_read_to_host_waits_for_the_current_stream_and_the_link() -> None:
    sim = SimBackend(mode="lazy", timing=LINK)
    device = sim.empty((NUMEL,), torch.float32)
    with sim.compute_scope():
        device.fill_(1.5)
    sim.model_compute(1e-3)
    computed = sim.modeled_times()
    assert computed is not None
    copy = sim.read_to_host(device)
    read = sim.modeled_times()
    assert read is not None and read.host == pytest.approx(computed.compute + NUMEL * 4 / 20e9), (
        "the host waits for the stream's work so far, then for the bytes to cross the link"
    )
    assert torch.equal(copy, torch.full((NUMEL,), 1.5)), "a copy of the values"


@pytest.mark.parametrize("reads", [True, False], ids=["read_to_host", "planted_no_wait"])
def test_a_read_to_host_orders_the_host_after_what_the_stream_waited_for(reads: bool) -> None:
    """The host then reads a host buffer that a copy the compute stream waited for wrote: ordered, no race; the
    same read without the wait is a race (the rule the journal of a first step relies on)."""
    sim = SimBackend(mode="lazy", on_race="record")
    device = sim.empty((64,), torch.float32)
    host = sim.empty_host(64, torch.float32)
    d2h = sim.new_stream()
    sim.wait_event(d2h, sim.record_event(sim.compute_stream()))
    sim.copy(host, device, stream=d2h)
    sim.wait_event(sim.compute_stream(), sim.record_event(d2h))
    if reads:
        sim.read_to_host(device)
    with sim.host_scope():
        host.add_(1.0)
    assert bool(sim.races) is not reads, sim.races


def _swapped(sim: SimBackend, **options: object) -> tuple[list[torch.Tensor], SwapOptimizer]:
    params = [torch.nn.Parameter(torch.randn(NUMEL, generator=torch.Generator().manual_seed(i))) for i in range(8)]
    config = SwapConfig(backend=sim, **{"swap_times": 4, **options})  # type: ignore[arg-type]
    return params, swap_optimizer(torch.optim.RMSprop(params, lr=1e-3), config)


def _loop(optimizer: SwapOptimizer, params: list[torch.Tensor], sim: SimBackend) -> list[float]:
    def step() -> None:
        for param in params:
            param.grad = torch.ones_like(param)
        optimizer.step()

    return modeled_iterations(sim, step, forward_backward_seconds=FORWARD_BACKWARD, iterations=4)


def _assert_the_host_never_waits_for_the_copies(iterations: list[float], optimizer: SwapOptimizer) -> None:
    """Steady state: each iteration is its forward and backward plus the step's time on the compute stream."""
    step_seconds = optimizer.stats.modeled_step_seconds
    assert step_seconds is not None
    assert iterations[-1] == pytest.approx(FORWARD_BACKWARD + step_seconds, rel=1e-9), (iterations, step_seconds)


@pytest.mark.parametrize("prefetch", ["off", "backward"])
def test_a_training_loop_iteration_is_the_forward_backward_plus_the_steps_compute_time(prefetch: str) -> None:
    sim = SimBackend(mode="lazy", check_races=False, poison=False, timing=LINK)
    params, optimizer = _swapped(sim, prefetch=prefetch)
    iterations = _loop(optimizer, params, sim)
    _assert_the_host_never_waits_for_the_copies(iterations, optimizer)
    transfer = optimizer.stats.modeled_transfer_seconds
    assert transfer is not None and optimizer.stats.modeled_step_seconds is not None
    assert transfer > optimizer.stats.modeled_step_seconds, "the last copy-out runs into the next forward"


def test_planted_bug_a_host_wait_at_the_end_of_step_lengthens_the_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = SimBackend(mode="lazy", check_races=False, poison=False, timing=LINK)
    params, optimizer = _swapped(sim)
    waiting_step = SwapOptimizer.step

    def step_then_wait(self: SwapOptimizer, closure: object = None) -> object:
        loss = waiting_step(self)
        self.synchronize()  # the planted extra wait: the host blocks on the last copy-out
        return loss

    monkeypatch.setattr(SwapOptimizer, "step", step_then_wait)
    iterations = _loop(optimizer, params, sim)
    with pytest.raises(AssertionError):
        _assert_the_host_never_waits_for_the_copies(iterations, optimizer)


def test_transfer_seconds_are_measured_on_the_copy_streams_when_the_host_runs_ahead() -> None:
    """The host issues the prefetch long before the backward ends; the copies start only after it (they wait for
    the compute stream), and the transfer time counts from their start, not from the host's launch."""
    sim = SimBackend(mode="lazy", check_races=False, poison=False, timing=LINK)
    params, optimizer = _swapped(sim)
    for _ in range(3):
        for param in params:
            param.grad = torch.ones_like(param)
        sim.model_compute(0.1)  # a long backward; the host is 100 ms ahead of the device
        optimizer.prefetch()
        optimizer.step()
    transfer = optimizer.stats.modeled_transfer_seconds
    assert transfer is not None
    one_way = optimizer.stats.h2d_bytes / (LINK.h2d_gbps * 1e9)
    assert one_way < transfer < 2 * one_way, f"{transfer * 1e3:.3f} ms of transfers for {one_way * 1e3:.3f} ms each way"
