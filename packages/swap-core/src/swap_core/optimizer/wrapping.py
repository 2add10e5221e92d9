"""What wrapping refuses before anything changes, and swap's own hooks on the wrapped optimizer."""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from ..adapters.base import AdapterFactory, StateSwapAdapter
from ..adapters.overrides import check_instance_step
from ..backends.protocol import DeviceBackend
from ..config import SwapConfig
from ..errors import UnsupportedOptimizerError
from ..master_weights.fp32_view import fp32_masters
from ..master_weights.policy import Masters
from ..runtime.auto_batches import AUTO_NEEDS_MEMORY
from ..runtime.state_keys import MASTER_KEY, REMAINDER_KEY
from ..runtime.tracked_state import TrackedState
from ..torch_compat import remove_hooks

__all__ = [
    "WRAPPERS",
    "Wrapper",
    "check_arguments",
    "check_distinct_params",
    "check_not_wrapped",
    "check_state_assignable",
    "check_states",
    "check_wrapped_state",
    "exported",
    "group_params",
    "make_adapter",
    "ordered_params",
    "ordered_params_with_groups",
    "overrides",
    "rebind",
    "remove_swap_hooks",
    "swap_keys",
    "synchronized",
]

_LOG = logging.getLogger("swap_core")


class Wrapper(Protocol):
    """What the rooms below the torch face know of a :class:`~swap_core.SwapOptimizer`."""

    optimizer: torch.optim.Optimizer

    def synchronize(self) -> None: ...

    def outside_step(self, name: str, *args: Any, **kwargs: Any) -> Any: ...


WRAPPERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[Wrapper]] = weakref.WeakKeyDictionary()
"""The live wrapper of each wrapped optimizer: a second wrapper would keep a second copy of its state."""


def check_arguments(
    wrapper_type: type[torch.optim.Optimizer],
    optimizer: object,
    config: SwapConfig | None,
    adapter_factory: AdapterFactory | None,
) -> tuple[torch.optim.Optimizer, SwapConfig, AdapterFactory]:
    """``wrapper_type(optimizer, config, adapter_factory)``'s arguments checked, and the default config; then every
    refusal that needs no adapter, before anything (the wrapped optimizer included) changes."""
    if isinstance(optimizer, wrapper_type):
        raise ValueError("The optimizer is already a SwapOptimizer; wrap the plain torch optimizer once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"Expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if config is None:
        config = SwapConfig()
    if not isinstance(config, SwapConfig):
        raise TypeError(f"config must be a SwapConfig, got {type(config).__name__}")
    if adapter_factory is None:
        raise TypeError("SwapOptimizer needs an adapter_factory; use swap_optimizer() to find one automatically")
    check_not_wrapped(optimizer)
    check_state_assignable(optimizer)
    check_instance_step(optimizer)
    check_distinct_params(optimizer.param_groups)
    return optimizer, config, adapter_factory


def make_adapter(
    optimizer: torch.optim.Optimizer, masters: Masters, adapter_factory: AdapterFactory
) -> StateSwapAdapter:
    """The family adapter of ``optimizer``. It reads existing states as its optimizer would have made them (a deep
    copy's, a checkpoint's loaded before wrapping): with master weights, the masters (swap's, not the
    optimizer's) are set aside meanwhile."""
    with masters.set_aside(optimizer):
        return adapter_factory(optimizer)


def check_wrapped_state(
    optimizer: torch.optim.Optimizer,
    adapter: StateSwapAdapter,
    config: SwapConfig,
    masters: Masters,
    backend: DeviceBackend | None,
) -> None:
    """The refusals that need the adapter and the backend: unknown ``state_keys``, ``swap_times="auto"`` without a
    measure of device memory, master weights the family cannot keep, states the update could not use."""
    params = ordered_params(optimizer.param_groups)
    swap_keys(optimizer, adapter, config, masters)  # refuses unknown state_keys
    if config.swap_times == "auto" and backend is not None and backend.available_device_bytes() is None:
        raise ValueError(AUTO_NEEDS_MEMORY.format(backend=backend.name))
    masters.check_supported(optimizer, adapter, params)
    if backend is not None:  # unswapped (CPU parameters), the wrapped optimizer's step takes any state
        # States made before wrapping without masters (Adagrad's constructor makes them) get theirs at wrapping.
        check_states(
            optimizer,
            adapter,
            ordered_params_with_groups(optimizer.param_groups),
            UnsupportedOptimizerError,
            masters=masters,
            masters_to_make=True,
        )


def check_not_wrapped(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that a live :class:`SwapOptimizer` already wraps."""
    reference = WRAPPERS.get(optimizer)
    if reference is not None and reference() is not None:
        raise UnsupportedOptimizerError(
            f"This {type(optimizer).__name__} is already wrapped by a SwapOptimizer: step that one. A second wrapper "
            "would keep a second copy of the state in host memory, and the two would diverge silently"
        )


def check_state_assignable(optimizer: torch.optim.Optimizer) -> None:
    """A class whose ``state`` cannot be assigned (a read-only property): swapping follows the user's edits of
    ``state`` through a mapping of its own, which it must put in place (torch's own ``load_state_dict`` assigns
    ``state`` too). Tried by assigning the optimizer its own state back, which changes nothing."""
    try:
        optimizer.state = optimizer.state
    except AttributeError as error:
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__name__}.state cannot be assigned ({error}): a swapped optimizer replaces the state "
            "mapping with one that follows edits of it (as torch's own load_state_dict assigns state). Give the "
            "property a setter, or keep the state in the plain attribute torch.optim.Optimizer makes"
        ) from None


def check_distinct_params(groups: Sequence[Mapping[str, Any]]) -> None:
    """Every parameter once: torch would update a repeated one twice per step (and warns that it will refuse)."""
    first_seen: dict[int, tuple[int, int]] = {}
    for group_index, group in enumerate(groups):
        for position, param in enumerate(group_params(group)):
            seen = first_seen.setdefault(id(param), (group_index, position))
            if seen == (group_index, position):
                continue
            where = (
                f"twice in param group {group_index} (positions {seen[1]} and {position})"
                if seen[0] == group_index
                else f"in param groups {seen[0]} and {group_index}"
            )
            raise UnsupportedOptimizerError(
                f"Parameter {tuple(param.shape)} appears {where}: torch would update it twice per step, and a swapped "
                "optimizer keeps one state per parameter. List each parameter once"
            )


def swap_keys(
    optimizer: torch.optim.Optimizer, adapter: StateSwapAdapter, config: SwapConfig, masters: Masters
) -> tuple[str, ...] | None:
    """The state keys to swap (``None``: any), the requested ones checked against those the optimizer creates:
    a typo (``"momentum"`` for ``"momentum_buffer"``) would otherwise swap nothing, silently."""
    declared = adapter.swappable_keys
    # A family that swaps any key may still know the ones its optimizer creates (swap-generic's probe).
    known = tuple(sorted(adapter.created_keys)) if declared is None and adapter.created_keys else declared
    if known is not None:
        known = (*known, *masters.state_keys)
    requested = config.state_keys
    if requested is None:
        return None if declared is None else known
    unknown = [key for key in requested if known is not None and key not in known]
    if unknown:
        valid = list(known or ())
        raise ValueError(f"Unknown state_keys {unknown} for {type(optimizer).__name__}; swappable keys are {valid}")
    if MASTER_KEY in requested and REMAINDER_KEY in masters.state_keys and REMAINDER_KEY not in requested:
        return (*requested, REMAINDER_KEY)  # the master, in whichever form it is kept
    return requested


def group_params(param_group: Mapping[str, Any]) -> list[torch.Tensor]:
    """The parameters of ``param_group`` as a list (torch accepts one tensor, or any iterable, once)."""
    params = param_group.get("params", [])
    if isinstance(params, torch.Tensor):
        return [params]
    return list(params)


def ordered_params(groups: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
    """Every parameter of ``groups``, in group order (the order torch's state dicts number them in)."""
    return [param for group in groups for param in group["params"]]


def ordered_params_with_groups(groups: Sequence[Mapping[str, Any]]) -> list[tuple[int, torch.Tensor]]:
    """``(group index, parameter)`` of every parameter of ``groups``, in group order."""
    return [(index, param) for index, group in enumerate(groups) for param in group["params"]]


def overrides(optimizer: torch.optim.Optimizer, method: str) -> bool:
    """Whether ``optimizer``'s class replaces ``torch.optim.Optimizer``'s ``method`` with one of its own."""
    return getattr(type(optimizer), method) is not getattr(torch.optim.Optimizer, method)


# -- swap's own hooks on the wrapped optimizer ------------------------------------
def remove_swap_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Remove the hooks a wrapper (a dead one, or one whose construction failed) registered on ``optimizer``."""
    remove_hooks(optimizer, _is_swap_hook)


def _is_swap_hook(hook: Callable[..., Any]) -> bool:
    return bool(getattr(hook, "_swap_core_hook", False))


def _tagged(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a hook as swap's own, so that wrapping the same optimizer again replaces it instead of adding one."""
    hook._swap_core_hook = True  # type: ignore[attr-defined]
    return hook


def synchronized(wrapper: Wrapper) -> Callable[[torch.optim.Optimizer], None]:
    """State-dict pre-hook: every offload finished before the host mirrors are read (weakly bound)."""
    reference = weakref.ref(wrapper)

    def synchronize(optimizer: torch.optim.Optimizer) -> None:
        live = reference()
        if live is not None:
            live.synchronize()

    return _tagged(synchronize)


def exported(adapter: StateSwapAdapter) -> Callable[[torch.optim.Optimizer, dict[str, Any]], dict[str, Any]]:
    """State-dict post-hook: the checkpoint form of the state, masters as fp32 (``fp32_masters``), then the
    adapter's (see ``export_state_dict``); the state as it is where the swap runtime does not keep it (nothing
    swapped: the wrapped optimizer's own step keeps it in its own layout)."""
    return _tagged(functools.partial(_export_state_dict, adapter))


def _export_state_dict(
    adapter: StateSwapAdapter, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> dict[str, Any]:
    if not isinstance(optimizer.state, TrackedState):
        return state_dict
    return adapter.export_state_dict(fp32_masters(optimizer, state_dict))


def check_states(
    optimizer: torch.optim.Optimizer,
    adapter: StateSwapAdapter,
    params: Sequence[tuple[int, torch.Tensor]],
    error: Callable[[str], Exception],
    *,
    masters: Masters,
    masters_to_make: bool = False,
) -> None:
    """Raise ``error`` naming the first parameter whose non-empty state the adapter's update cannot use (a state
    holding only its master is empty to the adapter: never asked about, the update creates the rest).

    ``params`` are ``(group index, parameter)``. ``masters_to_make``: a state without a master is to get one (made
    before wrapping), so only the adapter is asked about it.
    """
    for index, (group_index, param) in enumerate(params):
        state = optimizer.state.get(param)
        if not state:
            continue
        problem, state = masters.state_problem(param, state, to_make=masters_to_make)
        if problem is None and not state:  # its master alone: the update creates the rest, as for an empty state
            continue
        if problem is None:
            updated = masters.as_updated(param)
            problem = adapter.state_mismatch(updated, optimizer.param_groups[group_index], state)
        if problem is not None:
            raise error(
                f"The state of parameter {index} (param group {group_index}, shape {tuple(param.shape)}) "
                f"{problem}: {type(optimizer).__name__}'s update cannot use it, and nothing was changed. "
                "Load a complete checkpoint, or reset the entry (del optimizer.state[param]) to start it afresh"
            )


def rebind(groups: list[dict[str, Any]], state: Any, new_to_old_param: Mapping[torch.Tensor, torch.Tensor]) -> None:
    """``reset_optimizer_parameters(new_to_old_param)``: each new parameter takes the place of the one it replaces
    (same shape and dtype) in ``groups``, and its entry in ``state``; anything else is refused before any change."""
    current = set(map(id, ordered_params(groups)))
    old_to_new = {}
    for new, old in new_to_old_param.items():
        if id(old) not in current:
            raise ValueError(f"Parameter {tuple(old.shape)} to replace is not in this optimizer's param groups")
        if new.shape != old.shape or new.dtype != old.dtype:
            raise ValueError(
                f"Replacement parameter {tuple(new.shape)} {new.dtype} does not match {tuple(old.shape)} {old.dtype}"
            )
        old_to_new[id(old)] = new
    for group in groups:
        group["params"] = [old_to_new.get(id(param), param) for param in group["params"]]
    for new, old in new_to_old_param.items():
        if old in state:
            state[new] = state.pop(old)
