"""A current stream per thread: compute ops and allocations belong to it, on the simulator as on a device.

``with torch.cuda.stream(s):`` makes ``s`` the thread's current stream: kernels launch on it and the caching
allocator hands out ``s``'s blocks. The simulator models both (``SimBackend.stream``), so a step issued under
another stream, or a prefetch issued from a hook that runs under one (FSDP2 runs post-accumulate-grad hooks under
its post-reduce stream), is checked for what it orders against.
"""

from __future__ import annotations

import threading

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.errors import SimRaceError
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal

pytestmark = pytest.mark.sim_only


def test_compute_stream_is_the_threads_current_stream() -> None:
    sim = SimBackend()
    default = sim.compute_stream()
    side = sim.new_stream()
    seen: list[object] = []
    with sim.stream(side):
        assert sim.compute_stream() is side
        worker = threading.Thread(target=lambda: seen.append(sim.compute_stream()))
        worker.start()
        worker.join()
        with sim.stream(default):
            assert sim.compute_stream() is default
        assert sim.compute_stream() is side
    assert sim.compute_stream() is default
    assert seen == [default], "another thread keeps its own current stream"


def test_a_compute_op_on_the_current_stream_must_be_ordered_after_the_copy_it_reads() -> None:
    sim = SimBackend(mode="lazy")
    host = sim.empty_host(64, torch.float32)
    with sim.host_scope():
        host.fill_(2.0)
    device = sim.empty((64,), torch.float32)
    h2d, side = sim.new_stream(), sim.new_stream()
    sim.wait_event(h2d, sim.record_event(sim.compute_stream()))
    sim.copy(device, host, stream=h2d)
    sim.wait_event(sim.compute_stream(), sim.record_event(h2d))  # the default stream waits; `side` does not
    with sim.stream(side), sim.compute_scope(), pytest.raises(SimRaceError, match=r"read by stream2 \(aten::mul"):
        device.mul(2.0)
    sim.wait_event(side, sim.record_event(h2d))
    with sim.stream(side), sim.compute_scope():
        assert torch.equal(device.mul(2.0), torch.full((64,), 4.0)), "the queued wait ran before the op"


def test_memory_allocated_under_a_stream_belongs_to_it() -> None:
    sim = SimBackend(mode="lazy")
    side, h2d = sim.new_stream(), sim.new_stream()
    host = sim.empty_host(64, torch.float32)
    with sim.stream(side):
        staging = sim.empty((64,), torch.float32)
    sim.wait_event(h2d, sim.record_event(sim.compute_stream()))  # ordered after the default stream only
    with pytest.raises(SimRaceError, match=r"write by stream1 \(empty \(allocation\)\) and write by stream2"):
        sim.copy(staging, host, stream=h2d)


# -- what the rules catch in the optimizer -----------------------------------------------------------------------


def _rmsprop_pair(sim: SimBackend, **options: object) -> tuple[list[torch.Tensor], torch.optim.Optimizer, list, object]:
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(40, 48, generator=generator) for _ in range(4)]
    plain_params = [torch.nn.Parameter(value.clone()) for value in values]
    params = [torch.nn.Parameter(value.clone()) for value in values]
    plain = torch.optim.RMSprop(plain_params, lr=0.01)
    config = SwapConfig(backend=sim, **{"swap_times": 3, "min_numel": 16, **options})  # type: ignore[arg-type]
    return plain_params, plain, params, swap_optimizer(torch.optim.RMSprop(params, lr=0.01), config)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("mode", ["lazy", "random"])
def test_a_step_under_another_current_stream_updates_on_that_stream(mode: str, packed: bool) -> None:
    sim = SimBackend(mode=mode, seed=3)  # type: ignore[arg-type]
    plain_params, plain, params, swapped = _rmsprop_pair(sim, packed=packed)
    side = sim.new_stream()
    grads = torch.Generator().manual_seed(1)
    for step in range(4):
        for plain_param, param in zip(plain_params, params, strict=True):
            param.grad = torch.randn(param.shape, generator=grads)
            plain_param.grad = param.grad.clone()
        plain.step()
        if step % 2:
            with sim.stream(side):  # a graph capture's side stream, a user's torch.cuda.stream(s)
                swapped.step()  # type: ignore[attr-defined]
        else:
            swapped.step()  # type: ignore[attr-defined]
    for index, (expected, actual) in enumerate(zip(plain_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
    assert not sim.races, sim.races


def _model() -> torch.nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(24, 24) for _ in range(5)))


def test_a_prefetch_from_a_hook_under_another_stream_allocates_on_the_steps_stream() -> None:
    sim = SimBackend(mode="lazy")
    post_reduce = sim.new_stream()  # FSDP2 calls post-accumulate-grad hooks under its post-reduce stream
    plain_model, model = _model(), _model()
    plain = torch.optim.RMSprop(plain_model.parameters(), lr=0.01)
    config = SwapConfig(backend=sim, swap_times=3, min_numel=16, prefetch="backward")
    swapped = swap_optimizer(torch.optim.RMSprop(model.parameters(), lr=0.01), config)
    reserved = []
    for step in range(4):
        inputs = torch.randn(4, 24, generator=torch.Generator().manual_seed(step))
        plain.zero_grad()
        swapped.zero_grad()
        plain_model(inputs).square().mean().backward()
        with sim.stream(post_reduce):
            model(inputs).square().mean().backward()
        assert swapped.prefetched == (step > 0), "the hooks issued the prefetch (from the second backward on)"
        plain.step()
        swapped.step()
        swapped.synchronize()
        reserved.append(sim.memory_reserved())
    for index, (expected, actual) in enumerate(zip(plain_model.parameters(), model.parameters(), strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
    assert not sim.races, sim.races
    assert reserved[1:] == reserved[:-1], f"the staging took blocks of the post-reduce stream's pool: {reserved}"
