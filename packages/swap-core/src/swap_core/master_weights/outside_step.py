"""An optimizer's methods outside ``step()`` (schedule-free's ``eval()``) run over the fp32 masters, one parameter at a
time, its swapped states moved through their slots as a step moves them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, TypeVar

import torch

from ..adapters.group_values import GroupValues
from ..adapters.narrowed_groups import NarrowedGroups
from ..dtensor import wrap_local
from ..errors import SwapStateError
from ..runtime.nested_entries import located
from ..runtime.slots import SlotState, SwapSlot, transition
from ..runtime.state_keys import MASTER_KEY
from ..runtime.tracked_state import TrackedState

if TYPE_CHECKING:
    from ..backends.protocol import DeviceBackend

__all__ = ["outside_step_on_masters"]

_Result = TypeVar("_Result")


def outside_step_on_masters(
    optimizer: torch.optim.Optimizer,
    backend: DeviceBackend,
    slots: Mapping[torch.Tensor, Mapping[str, SwapSlot]],
    call: Callable[[], _Result],
    *,
    method: str = "method",
) -> _Result:
    """Run ``call`` (a method of ``optimizer`` that reads and writes parameters and states outside ``step()``) as the
    plain optimizer over fp32 masters would run it, one parameter at a time.

    For each parameter in turn, its swapped states and master (its ``slots``, from the store) are copied to the
    device, the param groups list only the master (the parameter itself when it has none) with those device states
    as its ``state`` entry, and ``call`` runs; the states and the master are then copied back to their host mirrors
    and the parameter is set from the master. The slots move ``host -> h2d -> device -> d2h -> host`` as in a step;
    if the call (or a copy) fails, that parameter's device copies are dropped and its host mirrors, which never
    changed, stay authoritative. Group values (``train_mode``...) are restored before each parameter's call, and
    every call must leave the same ones, which are kept (``method``, its name, names it otherwise); a call that
    changes the param groups is refused. Device memory: one parameter's states at a time. The caller has followed
    the user's edits, synchronized the optimizer and dropped any prefetch; host mirrors are current again when this
    returns.
    """
    values = GroupValues(optimizer, method=method, share="parameter", refusal=_not_one_parameter_at_a_time)
    narrowed = NarrowedGroups(optimizer, method=method)
    results: list[_Result] = []
    copied_out: list[SwapSlot] = []
    try:
        for group in list(optimizer.param_groups):
            for param in list(group["params"]):
                values.before_batch()
                staged = _staged(optimizer, backend, param, slots.get(param, {}), copied_out)
                with staged as presented, backend.compute_scope():
                    results.append(narrowed.run(call, group, [presented]))
                    if presented is not param:
                        with torch.no_grad():
                            param.copy_(presented)
                values.after_batch(len(results) - 1)
    except BaseException:
        # The groups as the calls that finished left them (as before any, where none did).
        if results:
            values.put_back_first_writes()
        else:
            values.put_back_start()
        raise
    finally:
        backend.synchronize()
        transition(copied_out, SlotState.D2H, SlotState.HOST)
    if not results:  # no parameter at all: once over the (empty) groups, as the plain optimizer would
        return call()
    return results[-1]


def _not_one_parameter_at_a_time(sentence: str) -> Exception:
    return SwapStateError(f"{sentence}: it cannot run one parameter at a time over fp32 masters")


@contextlib.contextmanager
def _staged(
    optimizer: torch.optim.Optimizer,
    backend: DeviceBackend,
    param: torch.Tensor,
    slots: Mapping[str, SwapSlot],
    copied_out: list[SwapSlot],
) -> Iterator[torch.Tensor]:
    """``param``'s master (or ``param``) with device copies of its swapped states (``slots``) as its ``state`` entry;
    the slots whose copy-out was issued go to ``copied_out`` (the host is to wait for them)."""
    entries = optimizer.state
    if not isinstance(entries, TrackedState):
        raise TypeError(f"outside_step_on_masters needs a SwapOptimizer's state, got a {type(entries).__name__}")
    state = dict.get(entries, param) or {}
    compute = backend.compute_stream()
    moving = list(slots.values())
    devices: list[torch.Tensor] = []
    try:
        for slot in moving:
            devices.append(slot.shaped(backend.empty((slot.numel,), slot.dtype)))
        with _dropped_on_failure(moving):
            for slot, device in zip(moving, devices, strict=True):
                backend.copy(device, slot.host_mirror, stream=compute)
            transition(moving, SlotState.HOST, SlotState.H2D)
            transition(moving, SlotState.H2D, SlotState.DEVICE)
            # Its own dicts, nested ones too: the method sees device copies where the live entry holds host mirrors.
            presented_state = {key: dict(value) if isinstance(value, dict) else value for key, value in state.items()}
            for slot, device in zip(moving, devices, strict=True):
                container, key = located(presented_state, slot.key)
                container[key] = wrap_local(device, slot.layout)
            master = presented_state.pop(MASTER_KEY, None)
            presented = master if isinstance(master, torch.Tensor) else param
            with entries.lent([(presented, presented_state)] if state else []):
                yield presented
            for slot, device in zip(moving, devices, strict=True):
                backend.copy(slot.host_mirror, device, stream=compute)
            # Only once every copy is enqueued: a failed enqueue drops the device copies.
            transition(moving, SlotState.DEVICE, SlotState.D2H)
        copied_out.extend(moving)
    finally:
        for device in devices:
            backend.release_storage(device)


@contextlib.contextmanager
def _dropped_on_failure(slots: list[SwapSlot]) -> Iterator[None]:
    """On failure, the slots' device copies (or copies in flight) are dropped: their host mirrors never changed."""
    try:
        yield
    except BaseException:
        for source in (SlotState.H2D, SlotState.DEVICE):
            transition([slot for slot in slots if slot.state is source], source, SlotState.HOST)
        raise
