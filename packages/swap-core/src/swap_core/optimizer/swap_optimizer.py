"""``SwapOptimizer``: a torch optimizer whose states live in host memory between steps.

The torch face only: construction, ``step()`` (follow, create, plan, run, finish), prefetch, state dicts,
param groups and copies. What the runtime knows of the wrapped optimizer's state is
:class:`~swap_core.optimizer.state_sync.StateSync`'s business, the plan
:class:`~swap_core.optimizer.plan_cache.PlanCache`'s, one step's work
:class:`~swap_core.optimizer.step_run.StepRun`'s, how states move the
:class:`~swap_core.runtime.pipeline.PipelineScheduler`'s, and how a batch is updated the adapter's.
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
from ..adapters.overrides import check_instance_step
from ..backend_selection import select_backend
from ..backends.protocol import DeviceBackend, ModeledTimes
from ..backward_prefetch import BackwardPrefetch
from ..config import SwapConfig
from ..errors import UnsupportedOptimizerError
from ..master_weights import MASTER_KEY, outside_step_on_masters
from ..runtime.auto_batches import AUTO_NEEDS_MEMORY
from ..runtime.pipeline import PipelineScheduler, drain_in_flight_copies
from ..runtime.plan import SwapPlan
from ..runtime.store import HostLayout
from ..stats import SwapStats
from ..torch_compat import note_step_for_lr_schedulers, share_hook_registries, step_hooks_silenced
from ..trace import StepTrace
from .auto_batching import AutoBatching
from .loading import STATES_BEFORE_WRAPPING, load_state_dict, make_masters_of_existing_states
from .outside_step import check_outside_step_methods, offer_outside_step_methods
from .plan_cache import PlanCache
from .state_sync import StateSync, check_states
from .step_run import StepRun
from .wrapping import (
    WRAPPERS,
    check_distinct_params,
    check_master_weights_supported,
    check_not_wrapped,
    check_state_assignable,
    exported,
    group_params,
    overrides,
    remove_swap_hooks,
    swap_keys,
    synchronized,
)

__all__ = ["SwapOptimizer"]

_AMP_ATTRIBUTES = ("grad_scale", "found_inf")

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
        if isinstance(optimizer, SwapOptimizer):
            raise ValueError("The optimizer is already a SwapOptimizer; wrap the plain torch optimizer once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"Expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if config is None:
            config = SwapConfig()
        if not isinstance(config, SwapConfig):
            raise TypeError(f"config must be a SwapConfig, got {type(config).__name__}")
        if adapter_factory is None:
            raise TypeError("SwapOptimizer needs an adapter_factory; use swap_optimizer() to find one automatically")
        # Everything that can refuse runs before anything (the wrapped optimizer included) changes.
        check_not_wrapped(optimizer)
        check_state_assignable(optimizer)
        check_instance_step(optimizer)
        check_distinct_params(optimizer.param_groups)
        self.optimizer = optimizer
        self.config = config
        self._adapter_factory = adapter_factory
        with _masters_set_aside(optimizer) if config.master_weights else contextlib.nullcontext():
            # An adapter reads existing states as its optimizer would have made them (a deep copy's, a
            # checkpoint's loaded before wrapping): the masters are swap's, not the optimizer's.
            self.adapter: StateSwapAdapter = adapter_factory(optimizer)
        check_outside_step_methods(type(self), optimizer, self.adapter)
        params = [param for group in optimizer.param_groups for param in group["params"]]
        self.backend: DeviceBackend | None = select_backend(
            config.backend, params, master_weights=config.master_weights
        )
        swap_keys(optimizer, self.adapter, config)  # refuses unknown state_keys
        if config.swap_times == "auto" and self.backend is not None and self.backend.available_device_bytes() is None:
            raise ValueError(AUTO_NEEDS_MEMORY.format(backend=self.backend.name))
        if config.master_weights:
            check_master_weights_supported(optimizer, self.adapter, params)
        if self.backend is not None:  # unswapped (CPU parameters), the wrapped optimizer's step takes any state
            # States made before wrapping without masters (Adagrad's constructor makes them) get theirs below.
            check_states(
                optimizer,
                self.adapter,
                [(index, param) for index, group in enumerate(optimizer.param_groups) for param in group["params"]],
                UnsupportedOptimizerError,
                master_weights=config.master_weights,
                masters_to_make=True,
            )
        self.stats = SwapStats()
        self.trace: StepTrace | None = None
        """The pipeline timeline of the last step when ``config.trace`` is on."""
        # GradScaler hands fused optimizers grad_scale/found_inf as attributes; step() forwards them.
        self._step_supports_amp_scaling = getattr(optimizer, "_step_supports_amp_scaling", False)
        self._scheduler: PipelineScheduler | None = None
        self._sync: StateSync | None = None
        self._plans: PlanCache | None = None
        self._backward_prefetch: BackwardPrefetch | None = None
        original_state = optimizer.state
        try:
            self._share_hooks()
            # Never a checkpoint of stale host mirrors, whichever handle's state_dict() is called.
            self.register_state_dict_pre_hook(synchronized(self), prepend=True)
            # First post-hook: user hooks see the checkpoint form of the state dict.
            self.register_state_dict_post_hook(exported(self.adapter), prepend=True)
            if self.backend is not None:
                self._start_swapping(self.backend)
        except BaseException:
            # The wrapped optimizer is left as it was: its own state mapping, none of swap's hooks.
            optimizer.state = original_state
            remove_swap_hooks(optimizer)
            raise
        if config.prefetch == "backward" and self.backend is not None:
            self._backward_prefetch = BackwardPrefetch(self, self._prefetch_from_backward)
            self._arm_backward_prefetch(after_step=False)  # states loaded or deep-copied: the first backward prefetches
        WRAPPERS[optimizer] = weakref.ref(self)
        offer_outside_step_methods(self, self.adapter)

    def _start_swapping(self, backend: DeviceBackend) -> None:
        """The runtime takes over the wrapped optimizer's states: host mirrors, masters, the plan's cache."""
        scheduler = PipelineScheduler(backend, duplex=self.config.duplex)
        sync = StateSync(self.optimizer, self.adapter, self.config, backend, scheduler)
        self._scheduler, self._sync = scheduler, sync
        weakref.finalize(self, drain_in_flight_copies, scheduler)
        auto = AutoBatching(self.config, backend) if self.config.swap_times == "auto" else None
        self._plans = PlanCache(sync, auto)
        sync.start()  # existing states move to host memory (may find the host too small)
        if self.config.master_weights:
            make_masters_of_existing_states(sync, STATES_BEFORE_WRAPPING, stacklevel=5)

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
        method = functools.partial(getattr(type(self.optimizer), name), self.optimizer, *args, **kwargs)
        if self._scheduler is None:
            return method()
        self.synchronize()
        self._scheduler.discard_prefetch()
        if not self.config.master_weights:
            return method()
        assert self.backend is not None
        return outside_step_on_masters(self.optimizer, self.backend, method)

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
        if self.backend is not None and self.backend.is_capturing():
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
        with self._amp_attributes_forwarded():
            if self._sync is None or self._plans is None or self.backend is None:
                with step_hooks_silenced(self.optimizer):  # this step's hooks ran: not again for the wrapped one
                    self.optimizer.step()
                return loss
            started = time.perf_counter()
            modeled_start = self.backend.modeled_times()
            if modeled_start is not None and not self._sync.scheduler.prefetched:
                self.backend.start_transfer_window()  # else prefetch() started it: its copy-in is this step's first
            with self._sync.scheduler.working():  # reads of the state here wait for nothing
                stats, trace, plan = self._run_step(self._sync, self._plans)
            if self._backward_prefetch is not None:
                self._arm_backward_prefetch(after_step=True)
            self._sync.empty_host_cache_after_relayout()
            self.trace = trace
            note_step_for_lr_schedulers(self.optimizer)
        stats.resident_state_device_bytes = self._plans.resident_bytes
        stats.host_state_bytes = self._sync.store.host_bytes
        stats.host_pinned_bytes = self._sync.store.host_pinned_bytes
        stats.peak_state_device_bytes = plan.peak_staging_bytes + self._plans.resident_bytes
        stats.step_seconds = time.perf_counter() - started
        stats.available_device_bytes = self._plans.auto.available if self._plans.auto is not None else None
        if modeled_start is not None:
            _set_modeled_seconds(stats, modeled_start, self.backend.modeled_times())
        self.stats = stats
        return loss

    def _run_step(self, sync: StateSync, plans: PlanCache) -> tuple[SwapStats, StepTrace | None, SwapPlan]:
        """A :class:`StepRun` on the batches; with ``swap_times="auto"``, a second one with twice the batches after an
        out-of-memory that left everything as it was."""
        stats, trace, run = SwapStats(), StepTrace() if self.config.trace else None, StepRun(sync, plans)
        try:
            return stats, trace, run.run(stats, trace)
        except torch.OutOfMemoryError as error:
            if plans.auto is None or not plans.auto.more_batches_after(error, run.batches_updated):
                raise
        finally:
            run.release()  # zero_grad(set_to_none=True) must be able to free the gradients
        plans.drop()
        stats, trace, run = SwapStats(), StepTrace() if self.config.trace else None, StepRun(sync, plans)
        try:
            return stats, trace, run.run(stats, trace)
        except torch.OutOfMemoryError as again:
            raise plans.auto.still_out_of_memory(again, plans.last) from again
        finally:
            run.release()

    def prefetch(self) -> None:
        """Start copying the first batch's states to the device now, ahead of ``step()`` (e.g. right after backward).

        The next ``step()`` then begins with that batch already on its way, so the copy overlaps what
        runs before it. Idempotent: a second call before the step does nothing. Nothing happens with
        CPU parameters, or while the first batch has no state to copy (before the first step). If the state
        or the param groups change before the step (a load, an edit, states the step creates for parameters
        with their first gradient), the step drops the prefetch and runs as without it; ``synchronize()``
        waits for its copy. ``SwapConfig(prefetch="backward")`` calls it from the backward. Reading ``state``
        between ``prefetch()`` and ``step()`` drops the prefetch (the read may be an edit in place, which the
        copy already made would miss); a host tensor kept from an earlier read and written in place after the
        copy started would not reach that step.
        """
        sync, plans = self._sync, self._plans
        if sync is None or plans is None or sync.scheduler.prefetched:
            return
        with sync.scheduler.working():
            sync.follow_edits(sync.ordered_params())
            plan = plans.current()
            if not plan.batches or not plan.batches[0].slots:  # nothing to copy in yet: the first step makes the states
                return
            sync.backend.start_transfer_window()
            sync.scheduler.prefetch(plan)

    def _prefetch_from_backward(self) -> None:
        """:meth:`prefetch` from a gradient hook: on the stream the steps run on, whatever stream the hook runs under
        (FSDP2 runs post-accumulate-grad hooks under its post-reduce stream: staging allocated there would belong
        to that stream's pool, and the copy-in, ordered after the step's stream only, could overwrite a block the
        reduce-scatter still reads)."""
        assert self._sync is not None
        with self._sync.backend.stream(self._sync.scheduler.compute):
            self.prefetch()

    @property
    def prefetched(self) -> bool:
        """Whether the next step's first copy-in is already issued (by :meth:`prefetch`, or from the backward with
        ``SwapConfig(prefetch="backward")``); ``False`` again once a step ran."""
        return self._scheduler is not None and self._scheduler.prefetched

    def _arm_backward_prefetch(self, *, after_step: bool) -> None:
        """``prefetch="backward"``: the next backward prefetches once the first batch's gradients are final.

        Awaited are the parameters of the batch the next step walks first that had a gradient in the step
        that just ran (``after_step``; before any step: those that require one). See
        :mod:`swap_core.backward_prefetch` for the rules and why an early prefetch stays right.
        """
        assert self._backward_prefetch is not None
        assert self._plans is not None
        plan = self._plans.current()
        first = [param for _, param in plan.batches[0].params] if plan.batches else []
        self._backward_prefetch.arm(
            param for param in first if (param.grad is not None if after_step else param.requires_grad)
        )

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
        if self._sync is None or self._plans is None:
            raise ValueError(
                "This SwapOptimizer swaps nothing (its parameters are on the CPU, backend='auto'), so it plans no "
                "batches; give its parameters an accelerator or pass SwapConfig(backend=...)"
            )
        self._sync.follow_edits(self._sync.ordered_params())
        return self._plans.current()

    def host_layout(self) -> HostLayout:
        """Which states are swapped and how their host memory is laid out, as of now (a read-only snapshot).

        Raises ``ValueError`` when nothing is swapped (CPU parameters with ``backend="auto"``).
        """
        if self._sync is None:
            raise ValueError("This SwapOptimizer swaps nothing (its parameters are on the CPU, backend='auto')")
        return self._sync.store.host_layout()

    # -- synchronization and state dicts -------------------------------------
    def synchronize(self) -> None:
        """Block until every offload has finished, so host mirrors in ``state`` are current."""
        if self._scheduler is not None:
            self._scheduler.synchronize()

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
        sync = self._sync
        if sync is None:
            raise RuntimeError(
                "initialize_state() needs a swap backend; with CPU parameters the wrapped optimizer runs "
                "unswapped and creates its states on its first step"
            )
        if self.adapter.lazy_states:
            raise UnsupportedOptimizerError(
                f"initialize_state() cannot create the states of {type(self.optimizer).__name__}: its adapter "
                f"({type(self.adapter).__name__}) runs the optimizer's own step, which creates them; call step() "
                "once instead (or load a checkpoint of this optimizer)"
            )
        self.synchronize()
        sync.follow_edits(sync.ordered_params())
        sync.create_missing_states(
            (group_index, param) for group_index, param in sync.ordered_params_with_groups() if param.requires_grad
        )

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
        load_state_dict(self, self.optimizer, self.adapter, self._sync, state_dict)

    # -- parameters -----------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its states are created and swapped on its first step."""
        if not hasattr(self, "optimizer"):  # torch's Optimizer machinery may call this before __init__ ends
            raise RuntimeError("SwapOptimizer is not initialized")
        param_group["params"] = group_params(param_group)  # as torch's add_param_group does (a generator once)
        check_distinct_params([*self.param_groups, param_group])
        if self.config.master_weights:
            check_master_weights_supported(self.optimizer, self.adapter, param_group["params"])
        if self._sync is None or self.backend is None:
            self.optimizer.add_param_group(param_group)
            return
        select_backend(self.backend, [*self._sync.ordered_params(), *param_group["params"]])
        self.synchronize()
        self.optimizer.add_param_group(param_group)
        self._sync.follow_edits(self._sync.ordered_params())

    def reset_optimizer_parameters(self, new_to_old_param: Mapping[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Re-bind the optimizer after the model's parameter objects changed.

        ``new_to_old_param`` maps each new parameter to the one it replaces (same
        shape and dtype): param groups and states move to the new objects, host
        mirrors stay where they are. Without it, the swap plan is rebuilt from
        the current ``param_groups`` and ``state`` (after editing them by hand).
        """
        self.synchronize()
        if new_to_old_param:
            self._rebind(new_to_old_param)
        if self._sync is None:
            self.adapter.params_changed([param for group in self.param_groups for param in group["params"]])
            return
        self._sync.forget_layout()  # re-plan even when the order looks unchanged
        self._sync.follow_edits(self._sync.ordered_params())

    def _rebind(self, new_to_old_param: Mapping[torch.Tensor, torch.Tensor]) -> None:
        current = {id(param) for group in self.param_groups for param in group["params"]}
        old_to_new = {}
        for new, old in new_to_old_param.items():
            if id(old) not in current:
                raise ValueError(f"Parameter {tuple(old.shape)} to replace is not in this optimizer's param groups")
            if new.shape != old.shape or new.dtype != old.dtype:
                raise ValueError(
                    f"Replacement parameter {tuple(new.shape)} {new.dtype} does not match "
                    f"{tuple(old.shape)} {old.dtype}"
                )
            old_to_new[id(old)] = new
        for group in self.param_groups:
            group["params"] = [old_to_new.get(id(param), param) for param in group["params"]]
        for new, old in new_to_old_param.items():
            if old in self.state:
                self.state[new] = self.state.pop(old)
        if self._sync is not None:
            self._sync.rekey(new_to_old_param)


def _set_modeled_seconds(stats: SwapStats, start: ModeledTimes, end: ModeledTimes | None) -> None:
    """``stats.modeled_step_seconds`` from the virtual clock at entry and at exit; ``modeled_transfer_seconds`` on
    the copy streams: from the start of the step's first copy (a ``prefetch()``'s, if it ran one) to the end of
    its last."""
    assert end is not None
    entered = max(start.host, start.compute)
    stats.modeled_step_seconds = max(end.compute - entered, 0.0)
    first = end.transfers_started
    stats.modeled_transfer_seconds = max(end.transfers - first, 0.0) if first is not None else 0.0


@contextlib.contextmanager
def _masters_set_aside(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """``optimizer.state`` without the fp32 masters for the duration (put back whatever happens)."""
    masters: list[tuple[dict[str, Any], Any]] = []
    for state in optimizer.state.values():
        if isinstance(state, dict) and MASTER_KEY in state:
            masters.append((state, dict.pop(state, MASTER_KEY)))
    try:
        yield
    finally:
        for state, master in masters:
            dict.__setitem__(state, MASTER_KEY, master)
