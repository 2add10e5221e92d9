"""An optimizer's methods outside ``step()`` (schedule-free's ``eval()``) run over the fp32 masters."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import torch

from ..errors import SwapStateError
from ..runtime.group_values import GroupValues
from ..runtime.narrowed_groups import NarrowedGroups
from ..runtime.state_keys import MASTER_KEY
from ..runtime.tracked_state import TrackedState

if TYPE_CHECKING:
    from ..backends.protocol import DeviceBackend

__all__ = ["outside_step_on_masters"]

_Result = TypeVar("_Result")


def outside_step_on_masters(
    optimizer: torch.optim.Optimizer, backend: DeviceBackend, call: Callable[[], _Result], *, method: str = "method"
) -> _Result:
    """Run ``call`` (a method of ``optimizer`` that reads and writes parameters and states outside ``step()``) as the
    plain optimizer over fp32 masters would run it, one parameter at a time.

    For each parameter in turn, its swapped states and master are copied to the device, the param groups list only
    the master (the parameter itself when it has none) with those device states as its ``state`` entry, and
    ``call`` runs; the states and the master are then copied back to their host mirrors and the parameter is set
    from the master. Group values (``train_mode``...) are restored before each parameter's call, and every call
    must leave the same ones, which are kept (``method``, its name, names it otherwise); a call that changes the
    param groups is refused. Device memory: one parameter's states at a time. The caller has
    synchronized the optimizer and dropped any prefetch; host mirrors are current again when this returns.
    """
    values = GroupValues(optimizer, method=method, share="parameter", refusal=_not_one_parameter_at_a_time)
    narrowed = NarrowedGroups(optimizer, method=method)
    results: list[_Result] = []
    try:
        for group in list(optimizer.param_groups):
            for param in list(group["params"]):
                values.before_batch()
                with _staged(optimizer, backend, param) as presented, backend.compute_scope():
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
    if not results:  # no parameter at all: once over the (empty) groups, as the plain optimizer would
        return call()
    return results[-1]


def _not_one_parameter_at_a_time(sentence: str) -> Exception:
    return SwapStateError(f"{sentence}: it cannot run one parameter at a time over fp32 masters")


@contextlib.contextmanager
def _staged(optimizer: torch.optim.Optimizer, backend: DeviceBackend, param: torch.Tensor) -> Iterator[torch.Tensor]:
    """``param``'s master (or ``param``) with device copies of its host-mirrored states as its ``state`` entry."""
    entries = optimizer.state
    if not isinstance(entries, TrackedState):
        raise TypeError(f"outside_step_on_masters needs a SwapOptimizer's state, got a {type(entries).__name__}")
    state = dict.get(entries, param) or {}
    compute = backend.compute_stream()
    staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and not backend.owns(value):
            device = backend.empty(tuple(value.shape), value.dtype)
            backend.copy(device, value, stream=compute)
            staged[key] = (value, device)
    presented_state = {key: staged[key][1] if key in staged else value for key, value in state.items()}
    master = presented_state.pop(MASTER_KEY, None)
    presented = master if isinstance(master, torch.Tensor) else param
    try:
        with entries.lent([(presented, presented_state)] if state else []):
            yield presented
        for host, device in staged.values():
            backend.copy(host, device, stream=compute)
    finally:
        for _, device in staged.values():
            backend.release_storage(device)
