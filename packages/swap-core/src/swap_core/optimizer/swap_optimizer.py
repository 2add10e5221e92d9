"""``SwapOptimizer``: a torch optimizer whose states live in host memory between steps.

The torch face only: construction, ``step()``, prefetch, state dicts, param groups and copies. Each asks what the
optimizer swaps with (:mod:`~swap_core.optimizer.swapping`: made once at wrapping, nothing for CPU parameters): the
modes decided into a :class:`~swap_core.optimizer.setup.SwapSetup`, the followed state
(:class:`~swap_core.optimizer.state_sync.StateSync`), the plans (:class:`~swap_core.optimizer.plan_cache.PlanCache`)
and the step driver chosen for ``SwapConfig.step`` (:mod:`~swap_core.optimizer.step_driver`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn, TypeVar, cast

import torch

from ..adapters.base import AdapterFactory, StateSwapAdapter
from ..backend_selection import select_backend
from ..backends.protocol import DeviceBackend
from ..config import StepMode, SwapConfig
from ..errors import UnsupportedOptimizerError
from ..master_weights.policy import masters_policy
from ..runtime.plan import SwapPlan
from ..runtime.store import HostLayout
from ..stats import SwapStats
from ..torch_compat import note_step_for_lr_schedulers, share_amp_scaling_support, share_hook_registries
from ..trace import StepTrace
from .in_backward import InBackward
from .outside_step import check_outside_step_methods, offer_outside_step_methods
from .step_driver import AfterBackward, StepDriver
from .swapping import NothingSwapped, Swapped, start_swapping
from .wrapping import (
    WRAPPERS,
    check_arguments,
    check_distinct_params,
    check_wrapped_state,
    exported,
    group_params,
    make_adapter,
    ordered_params,
    overrides,
    rebind,
    remove_swap_hooks,
    synchronized,
)

__all__ = ["SwapOptimizer"]

_AMP_ATTRIBUTES = ("grad_scale", "found_inf")
STEP_DRIVERS: Mapping[StepMode, type[StepDriver]] = {"after_backward": AfterBackward, "in_backward": InBackward}
"""The step driver of each ``SwapConfig.step``, chosen once when the optimizer is wrapped."""

_Function = TypeVar("_Function", bound=Callable[..., Any])


def _never_compiled(function: _Function) -> _Function:
    """``torch.compiler.disable(function)``, typed as ``function`` (torch leaves the decorator untyped)."""
    return cast("_Function", torch.compiler.disable(function))  # type: ignore[no-untyped-call]


class SwapOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` so that its states stream through the device during :meth:`step`.

    ``param_groups``, ``state``, ``defaults`` and the hook registries are the wrapped
    optimizer's own objects, so LR schedulers, gradient clipping and hooks see one
    optimizer, whichever handle they were given. Between steps every swapped state
    in ``state`` is a host tensor; reading ``state`` from outside a step first waits
    for the last step's copies (and drops a pending :meth:`prefetch`), so a read sees
    the last step's values and an edit in place is kept.

    What a torch user does to the optimizer is followed, as torch follows it, at the
    next step (or ``state_dict()``, ``initialize_state()``...): entries of ``state``
    reset or replaced (``del opt.state[p]``, ``opt.state[p] = {}``, a new tensor for
    a swapped key), param groups edited by hand or through the wrapped optimizer
    (``add_param_group``, ``load_state_dict``). A state that the step could not use
    (a missing key, a wrong shape) is refused before any parameter changes. See
    docs/behaviour.md for the list.
    """

    optimizer: torch.optim.Optimizer

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: SwapConfig | None = None,
        adapter_factory: AdapterFactory | None = None,
    ) -> None:
        optimizer, config, adapter_factory = check_arguments(SwapOptimizer, optimizer, config, adapter_factory)
        self.optimizer = optimizer
        self.config = config
        self._adapter_factory = adapter_factory
        self.adapter: StateSwapAdapter = make_adapter(optimizer, masters_policy(config.master_weights), adapter_factory)
        # Masters as remainders only where every update runs in step() (none taken back after writing its parameters,
        # none run outside it): see master_weights/policy.py.
        in_step_only = config.step == "after_backward" and not self.adapter.outside_step_methods
        self._masters = masters_policy(config.master_weights, in_step_only=in_step_only and config.master_remainders)
        check_outside_step_methods(type(self), optimizer, self.adapter)
        self.backend: DeviceBackend | None = select_backend(
            config.backend, ordered_params(optimizer.param_groups), master_weights=config.master_weights
        )
        check_wrapped_state(optimizer, self.adapter, config, self._masters, self.backend)
        self.stats = SwapStats()
        self.trace: StepTrace | None = None
        """The pipeline timeline of the last step when ``config.trace`` is on."""
        original_state = optimizer.state
        try:
            self._share_hooks()
            # Never a checkpoint of stale host mirrors, whichever handle's state_dict() is called.
            self.register_state_dict_pre_hook(synchronized(self), prepend=True)
            # First post-hook: user hooks see the checkpoint form of the state dict.
            self.register_state_dict_post_hook(exported(self.adapter), prepend=True)
            self._swapping: Swapped | NothingSwapped = start_swapping(
                self, optimizer, self.adapter, config, self._masters, self.backend, STEP_DRIVERS[config.step]
            )
        except BaseException:
            # The wrapped optimizer is left as it was: its own state mapping, none of swap's hooks.
            optimizer.state = original_state
            remove_swap_hooks(optimizer)
            raise
        # GradScaler hands fused optimizers grad_scale/found_inf as attributes; step() forwards them (or, where the
        # step driver claims them, refuses them: the batches updated before GradScaler could unscale or skip).
        share_amp_scaling_support(self, optimizer, always=self._swapping.claims_amp_scaling)
        WRAPPERS[optimizer] = weakref.ref(self)
        offer_outside_step_methods(self, self.adapter)

    def outside_step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped optimizer's method ``name``, one that reads and writes parameters and states outside
        ``step()`` (schedule-free's ``train()`` and ``eval()``), as the plain optimizer would run it.

        The adapter names such methods (``adapter.outside_step_methods``); ``swapped.eval()`` and the wrapped
        optimizer's own ``eval()`` come here. The offloads finish and a pending :meth:`prefetch` is dropped
        first, so the method sees, and may change, current states. With master weights it runs over the fp32
        masters, one parameter at a time, its states and master staged on the device
        (:func:`~swap_core.master_weights.outside_step_on_masters`); the parameters are then set from the masters.
        """
        if name not in self.adapter.outside_step_methods:
            raise ValueError(
                f"{name!r} is not a method run outside step() for {type(self.optimizer).__name__}; "
                f"{type(self.adapter).__name__} names {self.adapter.outside_step_methods or 'none'}"
            )
        call = functools.partial(getattr(type(self.optimizer), name), self.optimizer, *args, **kwargs)
        return self._swapping.outside_step(call, name)

    def _share_hooks(self) -> None:
        # Hooks registered on the plain optimizer (before wrapping, too) run once per step.
        share_hook_registries(self, self.optimizer)
        remove_swap_hooks(self.optimizer)  # an earlier (dead) wrapper's

    # -- the wrapped optimizer's own objects -----------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's ``param_groups`` (the same list object)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's ``state`` (the same mapping object)."""
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's ``defaults``."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def __repr__(self) -> str:
        backend = self.backend.name if self.backend is not None else "none (CPU parameters)"
        return f"SwapOptimizer({self.optimizer!r}, backend={backend}, config={self.config!r})"

    # -- copies ---------------------------------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> SwapOptimizer:
        """An independent swapped optimizer over a deep copy of the wrapped one (as ``deepcopy`` of torch's).

        The copy's states are the current values, in host memory of its own; parameters are copied
        through ``memo`` as torch copies them (deep-copy the model and the optimizer together to keep
        them paired). The backend and the config are shared, hooks are not (torch's deepcopy drops them).
        """
        self.synchronize()
        twin = SwapOptimizer(copy.deepcopy(self.optimizer, memo), self.config, self._adapter_factory)
        memo[id(self)] = twin
        return twin

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(
            "A SwapOptimizer cannot be pickled or saved with torch.save(optimizer): it holds device streams and "
            "pinned host memory. Save optimizer.state_dict() instead, and load it into a newly wrapped optimizer "
            "(copy.deepcopy(optimizer) gives an independent working copy)"
        )

    @_never_compiled
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update every parameter with a gradient; swapped states stream through the device.

        Not compiled: ``torch.compile(opt.step)`` runs it as it is (its streams, events and host buffers are
        orchestration no graph can hold; compile the model, and the adapters' own kernels stay torch's). Not
        capturable either: called while the current stream captures a CUDA graph, it refuses before anything
        changes.
        """
        if self._swapping.is_capturing():
            raise RuntimeError(
                "A swapped optimizer's step() cannot be captured in a CUDA graph: it copies states between host "
                "memory and the device and orders streams with events on every call. Capture the forward and "
                "backward only and call step() outside the graph, or use an unswapped optimizer with "
                "capturable=True for a fully captured step"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        swapping = self._swapping
        claimed = swapping.claims_amp_scaling and any(name in self.__dict__ for name in _AMP_ATTRIBUTES)
        if claimed:  # GradScaler handed the step its scale and whether a gradient holds inf: the driver takes them
            try:
                swapping.take_amp_scaling(self.__dict__.get("grad_scale"), self.__dict__.get("found_inf"))
            except BaseException:  # refused: GradScaler deletes them only after a step that returns
                for name in _AMP_ATTRIBUTES:
                    self.__dict__.pop(name, None)
                raise
        with contextlib.nullcontext() if claimed else self._amp_attributes_forwarded():
            started = time.perf_counter()
            window = swapping.open_transfer_window()
            outcome = swapping.driver.step()
            if outcome is None:  # nothing swapped: the wrapped optimizer stepped
                return loss
            if not outcome.skipped:
                note_step_for_lr_schedulers(self.optimizer)
        outcome.stats.step_seconds = time.perf_counter() - started
        swapping.close_transfer_window(outcome.stats, window)
        self.stats, self.trace = outcome.stats, outcome.trace
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; with ``SwapConfig(step="in_backward")`` a step begun inside the backward that
        ``step()`` did not end is taken back first (the loop skipped it, as after ``GradScaler`` found an inf)."""
        self._swapping.before_zero_grad(set_to_none=set_to_none)
        super().zero_grad(set_to_none)

    def close(self) -> None:
        """Let go of the parameters before the optimizer is dropped: with ``SwapConfig(step="in_backward")`` its
        gradient hooks go (it steps no more inside the backward) and a step begun there and not ended is taken back;
        the copies in flight finish. Garbage collection does the same; ``close()`` does it now (an optimizer still
        referenced by a cycle, say from a hook's closure, is collected only by the next ``gc.collect()``)."""
        self._swapping.close()

    def prefetch(self) -> None:
        """Start copying the first batches' states to the device now, ahead of ``step()`` (e.g. right after backward):
        as many as leave the staging memory room for the next one (one batch with ``SwapConfig(staging_buffers=2)``,
        the default; ``k - 1`` with ``k``).

        The next ``step()`` then begins with those batches already on their way, so the copies overlap what
        runs before it. Idempotent: a second call before the step does nothing. Nothing happens with
        CPU parameters, or while the first batch has no state to copy (before the first step). If the state
        or the param groups change before the step (a load, an edit, states the step creates for parameters
        with their first gradient), the step drops the prefetch and runs as without it; ``synchronize()``
        waits for its copy. ``SwapConfig(prefetch="backward")`` calls it from the backward. Reading ``state``
        between ``prefetch()`` and ``step()`` drops the prefetch (the read may be an edit in place, which the
        copy already made would miss); a host tensor kept from an earlier read and written in place after the
        copy started would not reach that step.
        """
        self._swapping.prefetch()

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        """For gradient accumulation with ``SwapConfig(step="in_backward")``: run the backwards of the micro-batches
        before the last one inside ``with opt.accumulating():``, so that their gradient hooks update nothing; the
        last backward, outside it, updates the batches. Nothing to do in the other mode (and with CPU parameters)."""
        return self._swapping.accumulating()

    @property
    def prefetched(self) -> bool:
        """Whether the next step's first copy-ins are already issued (by :meth:`prefetch`, or from the backward with
        ``SwapConfig(prefetch="backward")``); ``False`` again once a step ran."""
        return self._swapping.prefetched

    @contextlib.contextmanager
    def _amp_attributes_forwarded(self) -> Iterator[None]:
        """GradScaler sets ``grad_scale``/``found_inf`` on the optimizer it was given: this wrapper.

        The wrapped optimizer's math (and adapters) read them from the wrapped optimizer.
        """
        forwarded = [name for name in _AMP_ATTRIBUTES if name in self.__dict__]
        for name in forwarded:
            setattr(self.optimizer, name, self.__dict__[name])
        try:
            yield
        finally:
            for name in forwarded:
                self.optimizer.__dict__.pop(name, None)

    # -- inspection -------------------------------------------------------------
    def swap_plan(self) -> SwapPlan:
        """The plan the next ``step()`` walks, built now if anything it depends on changed: its batches, each
        one's states and copies, and the staging they take. For inspection (:mod:`swap_core.testing.views` presents
        it); a state the update could not use raises here as the step would.

        Raises ``ValueError`` when nothing is swapped (CPU parameters with ``backend="auto"``).
        """
        return self._swapping.swap_plan()

    def host_layout(self) -> HostLayout:
        """Which states are swapped and how their host memory is laid out, as of now (a read-only snapshot).

        Raises ``ValueError`` when nothing is swapped (CPU parameters with ``backend="auto"``).
        """
        return self._swapping.host_layout()

    # -- synchronization and state dicts -------------------------------------
    def synchronize(self) -> None:
        """Block until every offload has finished, so host mirrors in ``state`` are current."""
        self._swapping.synchronize()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()``, exactly, with swapped states as host tensors.

        Made by the wrapped class's own ``state_dict`` when it has one (bitsandbytes' nests its
        quantization state), else by torch's.

        Swapped tensors are the host mirrors themselves (no device copy, no extra
        host copy), so the result loads into a plain optimizer, whose
        ``load_state_dict`` moves them to the parameters' device, and
        ``torch.load(..., weights_only=True)`` reads a saved one.
        """
        self.synchronize()
        if overrides(self.optimizer, "state_dict"):
            # A format of its own (bitsandbytes nests its quantization state): the wrapped class's method makes it,
            # over the same state and the same (shared) hooks; the hooks receive the wrapped optimizer.
            own_format: dict[str, Any] = type(self.optimizer).state_dict(self.optimizer)
            return own_format
        return super().state_dict()

    def initialize_state(self) -> None:
        """Create the missing state of every parameter that requires a gradient, without a step.

        The states are exactly those the wrapped optimizer creates at the start of its first step
        (e.g. Adam's ``step`` 0 and zero moments); swapped ones are born in host memory, so this
        moves no byte to the device, runs no update and no collective. Parameters that have a state
        keep it. Checkpointing uses it instead of torch's initializing step (zero gradients, lr 0),
        which would stream every state through the device once and count a step.
        """
        if self.adapter.lazy_states:
            raise UnsupportedOptimizerError(
                f"initialize_state() cannot create the states of {type(self.optimizer).__name__}: its adapter "
                f"({type(self.adapter).__name__}) runs the optimizer's own step, which creates them; call step() "
                "once instead (or load a checkpoint of this optimizer)"
            )
        self._swapping.initialize_state()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict of this optimizer's family, swapped states straight into host memory.

        An optimizer class with a ``load_state_dict`` of its own (bitsandbytes') loads with
        it instead (its format, its casting, its checks), and the loaded states then move to
        host memory. Otherwise casting follows ``torch.optim.Optimizer.load_state_dict`` (floating states
        take the parameter's dtype, ``step`` is kept). The checkpoint is checked
        completely before anything is replaced, so a mismatch raises
        :class:`~swap_core.errors.StateDictMismatchError` with the state intact.

        Host memory: when the loaded swapped states have the live layout (a resume:
        the same parameters, keys, shapes and dtypes), their values are copied into
        the live host mirrors and nothing is allocated; a state dict that holds the
        mirrors themselves (``state_dict()``'s tensors, which DCP loads into) costs no
        copy at all. Otherwise the new layout is built in new host memory first and
        the old one is freed after it.
        """
        self._swapping.load_state_dict(self, state_dict)

    # -- parameters -----------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its states are created and swapped on its first step."""
        if not hasattr(self, "optimizer"):  # torch's Optimizer machinery may call this before __init__ ends
            raise RuntimeError("SwapOptimizer is not initialized")
        param_group["params"] = group_params(param_group)  # as torch's add_param_group does (a generator once)
        check_distinct_params([*self.param_groups, param_group])
        self._masters.check_supported(self.optimizer, self.adapter, param_group["params"])
        self._swapping.add_param_group(param_group)

    def reset_optimizer_parameters(self, new_to_old_param: Mapping[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Re-bind the optimizer after the model's parameter objects changed.

        ``new_to_old_param`` maps each new parameter to the one it replaces (same
        shape and dtype): param groups and states move to the new objects, host
        mirrors stay where they are. Without it, the swap plan is rebuilt from
        the current ``param_groups`` and ``state`` (after editing them by hand).
        """
        self.synchronize()
        if new_to_old_param:
            rebind(self.param_groups, self.state, new_to_old_param)
        self._swapping.params_replaced(new_to_old_param)
