"""The host touches host buffers only after the copies into and out of them: a rule the simulator enforces.

On a device, a device-to-host copy still in flight writes its host buffer behind the host's back: the host reads
stale values and a host write is overwritten. Inside ``host_scope()`` the simulator reports such an access as a
race, and in lazy mode it never runs a queued copy for it, so a missing wait also shows as a wrong number.
The optimizer's re-layouts (a parameter's first gradient in a later step, an edit of ``state`` or
``param_groups``) wait for the last offload before they read the host mirrors.
"""

from __future__ import annotations

import collections
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

import swap_core.optimizer.swapping as optimizer_module
from swap_core import SwapConfig, swap_optimizer
from swap_core.backends.protocol import Stream
from swap_core.errors import SimRaceError
from swap_core.runtime.pipeline import PipelineScheduler
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal

pytestmark = pytest.mark.sim_only  # the simulator's rules and what they catch


def _queued_d2h(sim: SimBackend, d2h: Stream | None = None) -> torch.Tensor:
    """A host buffer of 4.0s on its way (a queued device-to-host copy on ``d2h``, a new stream by default; lazy: not
    run yet)."""
    device = sim.empty((256,), torch.float32)
    with sim.compute_scope():
        device.fill_(4.0)
    host = sim.empty_host(256, torch.float32)
    with sim.host_scope():
        host.fill_(1.0)
    d2h = sim.new_stream() if d2h is None else d2h
    sim.wait_event(d2h, sim.record_event(sim.compute_stream()))
    sim.copy(host, device, stream=d2h)
    return host


def test_reading_a_host_buffer_a_queued_copy_writes_is_a_race() -> None:
    sim = SimBackend(mode="lazy")
    host = _queued_d2h(sim)
    with sim.host_scope(), pytest.raises(SimRaceError, match=r"write by stream1 \(copy d2h\) and read by host"):
        host.sum()


def test_a_host_access_runs_no_queued_copy() -> None:
    sim = SimBackend(mode="lazy", on_race="record")
    host = _queued_d2h(sim)
    with sim.host_scope():
        seen = host.clone()
    assert sim.pending_ops() == 1, "the copy is still queued"
    assert torch.equal(seen, torch.full((256,), 1.0)), "the host read what was there: the copy had not landed"
    assert len(sim.races) == 1


def test_writing_a_host_buffer_a_queued_copy_reads_is_a_race_and_reading_it_is_not() -> None:
    sim = SimBackend(mode="lazy")
    host = sim.empty_host(256, torch.float32)
    with sim.host_scope():
        host.fill_(2.0)
    device = sim.empty((256,), torch.float32)
    h2d = sim.new_stream()
    sim.wait_event(h2d, sim.record_event(sim.compute_stream()))
    sim.copy(device, host, stream=h2d)
    with sim.host_scope():
        assert host.sum().item() == 512.0, "two readers do not race"
        with pytest.raises(SimRaceError, match=r"read by stream1 \(copy h2d\) and write by host"):
            host.zero_()


def test_waiting_for_the_copy_orders_the_host_after_it() -> None:
    sim = SimBackend(mode="lazy")
    d2h = sim.new_stream()
    host = _queued_d2h(sim, d2h)
    done = sim.record_event(d2h)  # the copy's stream
    done.synchronize()
    with sim.host_scope():
        assert host.sum().item() == 1024.0
    assert not sim.races


# -- what the rule catches in the optimizer ---------------------------------------------------------------------------

Edit = Callable[[torch.optim.Optimizer, list[torch.Tensor]], None]


def _late_gradient(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    params[-1].requires_grad_(True)  # gradual unfreezing: the last parameter gets its first gradient now


def _reverse(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    optimizer.param_groups[0]["params"].reverse()


def _append(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    optimizer.param_groups[0]["params"].append(params[-1])
    params[-1].requires_grad_(True)


def _delete(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    del optimizer.state[params[0]]


def _replace_a_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    optimizer.state[params[1]]["square_avg"] = torch.full(params[1].shape, 0.5)


def _inner_add_param_group(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    params[-1].requires_grad_(True)
    inner.add_param_group({"params": [params[-1]]})


def _assign_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    inner: Any = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    inner.state = collections.defaultdict(dict, inner.state)  # a new mapping holding the same entries


EDITS: dict[str, Edit] = {
    "late_gradient": _late_gradient,
    "reverse": _reverse,
    "append": _append,
    "delete": _delete,
    "replace": _replace_a_state,
    "inner_add_param_group": _inner_add_param_group,
    "assign_state": _assign_state,
}
_IN_FIRST_GROUP = {"late_gradient", "reverse", "delete", "replace", "assign_state"}


def _run(edit: str, sim: SimBackend | None, *, master_weights: bool = False) -> tuple[list[torch.Tensor], Any]:
    """RMSprop over four parameters (the last frozen at first), stepped 5 times with ``edit`` before step 2."""
    generator = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if master_weights else torch.float32
    params = [torch.nn.Parameter(torch.randn(48, 40, generator=generator).to(dtype)) for _ in range(4)]
    params[-1].requires_grad_(False)
    listed = params if edit in _IN_FIRST_GROUP else params[:-1]
    optimizer: Any = torch.optim.RMSprop(listed, lr=0.01)
    if sim is not None:
        config = SwapConfig(backend=sim, swap_times=2, min_numel=16, master_weights=master_weights)
        optimizer = swap_optimizer(optimizer, config)
    elif master_weights:
        return _fp32_master_reference(edit, params)
    grads = torch.Generator().manual_seed(1)
    for step in range(5):
        if step == 2:
            EDITS[edit](optimizer, params)
        for param in params:
            param.grad = torch.randn(param.shape, generator=grads).to(dtype) if param.requires_grad else None
        optimizer.step()
    return params, optimizer


def _fp32_master_reference(edit: str, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
    masters = [torch.nn.Parameter(param.detach().float(), requires_grad=param.requires_grad) for param in params]
    listed = masters if edit in _IN_FIRST_GROUP else masters[:-1]
    optimizer = torch.optim.RMSprop(listed, lr=0.01)
    grads = torch.Generator().manual_seed(1)
    for step in range(5):
        if step == 2:
            EDITS[edit](optimizer, masters)
            params[-1].requires_grad_(masters[-1].requires_grad)
        for param, master in zip(params, masters, strict=True):
            grad = torch.randn(param.shape, generator=grads).to(param.dtype) if master.requires_grad else None
            master.grad = grad.float() if grad is not None else None
        optimizer.step()
        with torch.no_grad():
            for param, master in zip(params, masters, strict=True):
                param.copy_(master)
    return params, optimizer


@pytest.mark.parametrize(
    "edit,master_weights",
    # With master weights a deleted entry restarts its master from the bf16 parameter: not the fp32 reference's.
    [*((edit, False) for edit in EDITS), *((edit, True) for edit in EDITS if edit != "delete")],
)
def test_edits_between_steps_wait_for_the_last_offload_before_reading_host_mirrors(
    edit: str, master_weights: bool
) -> None:
    sim = SimBackend(mode="lazy")  # the last offload of each step stays queued until something waits for it
    expected, _ = _run(edit, None, master_weights=master_weights)
    actual, optimizer = _run(edit, sim, master_weights=master_weights)
    for index, (want, got) in enumerate(zip(expected, actual, strict=True)):
        assert_bitwise_equal(want, got, f"{edit}: parameter {index}")
    assert not sim.races, sim.races
    assert sim.pending_ops() > 0, "the last offload of the last step is still in flight: steps never wait for it"
    del optimizer


def test_planted_bug_a_relayout_that_does_not_wait_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PipelineScheduler, "synchronize", lambda self: None)  # the store's wait does nothing
    with pytest.raises(SimRaceError, match=r"copy d2h\) and read by host"):
        _run("late_gradient", SimBackend(mode="lazy"))


# -- registered host memory: freed only once the copies using it are done ----------------------------------------------


def test_letting_go_of_a_registered_buffer_with_a_copy_in_flight_is_reported() -> None:
    sim = SimBackend(mode="lazy")
    host = _queued_d2h(sim)
    del host
    gc.collect()
    assert len(sim.races) == 1 and "free of a registered host buffer" in sim.races[0], sim.races
    with pytest.raises(SimRaceError, match="free of a registered host buffer"):
        sim.synchronize()  # a garbage-collection callback cannot raise: the next call of the backend does


def test_a_registered_buffer_freed_after_its_copy_was_waited_for_is_not_a_race() -> None:
    sim = SimBackend(mode="lazy")
    host = _queued_d2h(sim)
    sim.synchronize()
    del host
    gc.collect()
    assert not sim.races


def test_a_caching_allocator_buffer_may_go_with_a_copy_in_flight() -> None:
    """torch's caching pinned allocator records an event per copy and reuses the block only after it."""
    sim = SimBackend(mode="lazy")
    host = sim.empty_host(256, torch.float32, mode="caching")
    device = sim.empty((256,), torch.float32)
    d2h = sim.new_stream()
    sim.wait_event(d2h, sim.record_event(sim.compute_stream()))
    sim.copy(host, device, stream=d2h)
    del host
    gc.collect()
    sim.synchronize()
    assert not sim.races


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_deleting_an_optimizer_right_after_its_step_waits_for_the_copies_first(packed: bool) -> None:
    sim = SimBackend(mode="lazy")
    params = [torch.nn.Parameter(torch.randn(48, 40)) for _ in range(4)]
    optimizer = swap_optimizer(torch.optim.RMSprop(params), SwapConfig(backend=sim, min_numel=16, packed=packed))
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    assert sim.pending_ops() > 0, "the last offload is in flight"
    del optimizer
    gc.collect()
    sim.synchronize()
    assert not sim.races, sim.races


def test_planted_bug_an_optimizer_collected_without_waiting_frees_buffers_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(optimizer_module, "drain_in_flight_copies", lambda scheduler: None)
    sim = SimBackend(mode="lazy", on_race="record")
    params = [torch.nn.Parameter(torch.randn(48, 40)) for _ in range(4)]
    optimizer = swap_optimizer(torch.optim.RMSprop(params), SwapConfig(backend=sim, min_numel=16))
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    del optimizer
    gc.collect()
    assert any("free of a registered host buffer" in race for race in sim.races), sim.races


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_a_state_reset_or_replaced_between_steps_frees_its_buffers_after_the_copies(packed: bool) -> None:
    sim = SimBackend(mode="lazy")
    params = [torch.nn.Parameter(torch.randn(48, 40)) for _ in range(4)]
    optimizer = swap_optimizer(torch.optim.RMSprop(params), SwapConfig(backend=sim, min_numel=16, packed=packed))
    for step in range(4):
        for param in params:
            param.grad = torch.ones_like(param)
        if step == 2:
            del optimizer.state[params[0]]
            optimizer.optimizer.state = collections.defaultdict(dict, optimizer.state)  # a new mapping
        optimizer.step()
        gc.collect()
    sim.synchronize()
    assert not sim.races, sim.races


def test_a_race_found_during_a_collection_keeps_nothing_of_the_code_it_interrupted_alive() -> None:
    """The report waits for the backend's next call without the frames the collection ran in (nor their tensors)."""
    sim = SimBackend(mode="lazy")
    host = _queued_d2h(sim)

    def unrelated_code() -> weakref.ref[torch.Tensor]:
        marker = torch.ones(8)
        nonlocal host
        del host  # collected here, inside this frame
        gc.collect()
        return weakref.ref(marker)

    marker = unrelated_code()
    gc.collect()
    assert marker() is None, "the pending race report kept the interrupted frame's tensors alive"
    with pytest.raises(SimRaceError, match="free of a registered host buffer"):
        sim.synchronize()


# -- a user's reads of opt.state between steps ---------------------------------------------------------------------


def _stepped_rmsprop(sim: SimBackend) -> tuple[list[torch.Tensor], Any]:
    params = [torch.nn.Parameter(torch.randn(48, 40, generator=torch.Generator().manual_seed(i))) for i in range(4)]
    optimizer = swap_optimizer(torch.optim.RMSprop(params, lr=0.01), SwapConfig(backend=sim, min_numel=16))
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    return params, optimizer


def test_reading_opt_state_between_steps_waits_for_the_last_offload() -> None:
    sim = SimBackend(mode="lazy")
    params, optimizer = _stepped_rmsprop(sim)
    assert sim.pending_ops() > 0, "the last offload is in flight"
    with sim.host_scope():  # the user's edit, checked as host code: it must come after the copy-out
        optimizer.state[params[-1]]["square_avg"].mul_(0.5)
    assert sim.pending_ops() == 0 and not sim.races


def test_planted_bug_no_wait_when_the_user_reads_opt_state_is_a_race(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PipelineScheduler, "settle_for_host", lambda self: None)
    sim = SimBackend(mode="lazy")
    params, optimizer = _stepped_rmsprop(sim)
    # The last batch's: a first step's journal waited for the earlier batches' copies (see test_failed_step.py).
    with sim.host_scope(), pytest.raises(SimRaceError, match=r"copy d2h\) and (read|write) by host"):
        optimizer.state[params[-1]]["square_avg"].mul_(0.5)


def test_a_step_reading_its_own_state_waits_for_nothing() -> None:
    """The optimizer's own reads of the state (a step, a prefetch) never wait: the no-edit path stays free of waits."""
    sim = SimBackend(mode="lazy")
    params, optimizer = _stepped_rmsprop(sim)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.prefetch()
    optimizer.step()
    assert sim.pending_ops() > 0, "the step's last offload is still in flight: nothing waited for it"
