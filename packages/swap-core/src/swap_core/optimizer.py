"""``SwapOptimizer``: a torch optimizer whose states live in host memory between steps.

Orchestration only: prepare (create missing states) -> partition (cached plan)
-> pipeline (prefetch / update / offload) -> finish (stats). Where states live
is the :class:`~swap_core.runtime.store.StateStore`'s business, how they move
is the :class:`~swap_core.runtime.pipeline.PipelineScheduler`'s, and how a batch
is updated is the adapter's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import operator
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NoReturn, TypeVar, cast

import torch

from .adapters.base import AdapterFactory, StateInit, StateSwapAdapter, UpdateBatch
from .adapters.overrides import check_instance_step
from .backend_selection import select_backend
from .backends.cpu import CpuBackend
from .backends.protocol import DeviceBackend
from .backends.sim import SimBackend
from .backends.sim.timing import ModeledTimes
from .backward_prefetch import BackwardPrefetch
from .config import SwapConfig
from .errors import DeviceMemoryError, SwapStateError, UnsupportedOptimizerError
from .master_weights import (
    MASTER_KEY,
    has_master,
    is_fresh,
    master_problem,
    on_masters,
    outside_step_on_masters,
    params_as_masters,
    stand_in,
    without_master,
)
from .runtime.auto_batches import AUTO_NEEDS_MEMORY, fewest_batches_that_fit
from .runtime.dtensor import local_tensor, shard_layout
from .runtime.pipeline import PipelineScheduler, drain_in_flight_copies
from .runtime.plan import Partition, PlannedBatch, SwapPlan, build_plan, staging_bytes
from .runtime.slots import SwapSlot, layout_stride
from .runtime.step_journal import StepJournal, note_partial_step
from .runtime.store import StateSource, StateStore
from .runtime.tracked_state import TrackedState
from .state_dict_loading import load_swapped_state
from .stats import SwapStats
from .torch_compat import (
    HOOK_REGISTRIES,
    hook_registries_set_aside,
    note_step_for_lr_schedulers,
    share_hook_registries,
    step_hooks_silenced,
)
from .trace import StepTrace

__all__ = ["SwapOptimizer"]

_LOG = logging.getLogger("swap_core")

_AMP_ATTRIBUTES = ("grad_scale", "found_inf")
_GRAD = operator.attrgetter("grad")
_IS_SPARSE = operator.attrgetter("is_sparse")

_LOAD_HOOK_DICTS = ("_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")
_STATE_DICT_HOOK_DICTS = ("_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks")

_PLAIN_CHECKPOINT = (
    f"The checkpoint has no {MASTER_KEY!r} for {{count}} bfloat16/float16 parameter(s) (saved without master "
    "weights): their fp32 masters start as the parameters' current values, and their loaded states are kept in fp32"
)
_LOW_PRECISION_MASTERS = (
    f"The checkpoint holds {{count}} {MASTER_KEY!r} in a lower precision than float32 (cast down before it was "
    "saved, e.g. with the model's own dtype): they load as float32 from their rounded values, so the precision "
    "master weights keep was lost before this load"
)
_STATES_BEFORE_WRAPPING = (
    "{count} bfloat16/float16 parameter(s) had optimizer states before wrapping (made by an earlier step or by "
    "{name}'s constructor) and no fp32 master: their masters start as the parameters, and their states are kept in "
    "fp32 from now on (cast from the parameters' dtype, so a state value that dtype cannot hold exactly differs "
    "from an fp32-master run's)"
)

_WRAPPERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[SwapOptimizer]] = weakref.WeakKeyDictionary()
"""The live wrapper of each wrapped optimizer: a second wrapper would keep a second copy of its state."""

Layout = tuple[list[int], list[int]]
"""Identity of ``param_groups``: the ids of the parameters in order, and the size of each group."""

_MirrorCheck = tuple[int, list[dict[str, Any]], list[str], list[torch.Tensor | None]]
"""``(store version, state entry, key and host mirror of each swapped state)``; dropped with its store."""


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
        _check_not_wrapped(optimizer)
        _check_state_assignable(optimizer)
        check_instance_step(optimizer)
        _check_distinct_params(optimizer.param_groups)
        self.optimizer = optimizer
        self.config = config
        self._adapter_factory = adapter_factory
        with _masters_set_aside(optimizer) if config.master_weights else contextlib.nullcontext():
            # An adapter reads existing states as its optimizer would have made them (a deep copy's, a
            # checkpoint's loaded before wrapping): the masters are swap's, not the optimizer's.
            self.adapter: StateSwapAdapter = adapter_factory(optimizer)
        self._check_outside_step_methods()
        self.backend: DeviceBackend | None = select_backend(
            config.backend, self._ordered_params(), master_weights=config.master_weights
        )
        self._swap_keys()  # refuses unknown state_keys
        if config.swap_times == "auto" and self.backend is not None and self.backend.available_device_bytes() is None:
            raise ValueError(AUTO_NEEDS_MEMORY.format(backend=self.backend.name))
        self._master_weights = config.master_weights
        if self._master_weights:
            self._check_master_weights_supported(self._ordered_params())
        if self.backend is not None:  # unswapped (CPU parameters), the wrapped optimizer's step takes any state
            # States made before wrapping without masters (Adagrad's constructor makes them) get theirs below.
            self._check_states(self._ordered_params_with_groups(), UnsupportedOptimizerError, masters_to_make=True)
        self.stats = SwapStats()
        self.trace: StepTrace | None = None
        """The pipeline timeline of the last step when ``config.trace`` is on."""
        # GradScaler hands fused optimizers grad_scale/found_inf as attributes; step() forwards them.
        self._step_supports_amp_scaling = getattr(optimizer, "_step_supports_amp_scaling", False)
        self._plan: SwapPlan | None = None
        self._plan_key: tuple[int, int] | None = None
        self._params_version = 0
        self._resident_bytes = 0
        self._every_param_ready = False
        self._step_grads: list[torch.Tensor | None] = []
        self._auto_floor = 1
        """``swap_times="auto"``: the fewest batches to consider (raised after an out-of-memory while staging)."""
        self._auto_logged: tuple[int, int | None] | None = None
        self._auto_tried: tuple[int, int] | None = None
        """``swap_times="auto"``: the batches of the last plan it chose, and the most it could choose."""
        self._auto_available: int | None = None
        """``swap_times="auto"``: the device bytes available when the current plan was chosen."""
        self._journal: StepJournal | None = None
        """The running step's journal, when it keeps one (see ``_step_journal``)."""
        self._batches_updated = 0
        self._tracked = TrackedState()
        self._host_cache_emptied_at: tuple[int, int] | None = None
        self._seen_state_version = -1
        self._layout: Layout = ([], [])
        self._mirror_check: _MirrorCheck | None = None
        self._scheduler: PipelineScheduler | None = None
        self._store: StateStore | None = None
        original_state = optimizer.state
        try:
            self._share_hooks()
            # Never a checkpoint of stale host mirrors, whichever handle's state_dict() is called.
            self.register_state_dict_pre_hook(_synchronized(self), prepend=True)
            # First post-hook: user hooks see the checkpoint form of the state dict.
            self.register_state_dict_post_hook(_exported(self.adapter), prepend=True)
            if self.backend is not None:
                self._scheduler = PipelineScheduler(self.backend, duplex=config.duplex)
                weakref.finalize(self, drain_in_flight_copies, self._scheduler)
                self._adopt_params()
                self._adopt_state()  # existing states move to host memory (may find the host too small)
                self._layout = _layout(self.param_groups, self._ordered_params())
                if self._master_weights:
                    self._make_masters_of_existing_states(_STATES_BEFORE_WRAPPING, stacklevel=4)
        except BaseException:
            # The wrapped optimizer is left as it was: its own state mapping, none of swap's hooks.
            optimizer.state = original_state
            _remove_swap_hooks(optimizer)
            raise
        self._backward_prefetch: BackwardPrefetch | None = None
        if config.prefetch == "backward" and self._scheduler is not None:
            self._backward_prefetch = BackwardPrefetch(self, self._prefetch_from_backward)
            self._arm_backward_prefetch(after_step=False)  # states loaded or deep-copied: the first backward prefetches
        _WRAPPERS[optimizer] = weakref.ref(self)
        self._offer_outside_step_methods()

    def _check_outside_step_methods(self) -> None:
        """Refuse, before anything changes, a name the adapter declares that the optimizer's class lacks."""
        for name in self.adapter.outside_step_methods:
            if not callable(getattr(type(self.optimizer), name, None)) or hasattr(type(self), name):
                raise TypeError(
                    f"{type(self.adapter).__name__} declares {name!r} as a method of {type(self.optimizer).__name__} "
                    "run outside step(), but the optimizer's class has no such method (or SwapOptimizer has one)"
                )

    def _offer_outside_step_methods(self) -> None:
        """``swapped.eval()`` and the wrapped optimizer's own ``eval()`` both run :meth:`outside_step`."""
        for name in self.adapter.outside_step_methods:
            self.__dict__[name] = functools.partial(self.outside_step, name)
            self.optimizer.__dict__[name] = _OutsideStepRedirect(self.optimizer, name)

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
        if not self._master_weights:
            return method()
        assert self.backend is not None
        return outside_step_on_masters(self.optimizer, self.backend, method)

    def _share_hooks(self) -> None:
        # Hooks registered on the plain optimizer (before wrapping, too) run once per step.
        share_hook_registries(self, self.optimizer)
        _remove_swap_hooks(self.optimizer)  # an earlier (dead) wrapper's

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

    # -- step -----------------------------------------------------------------
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
            if self._scheduler is None:
                with step_hooks_silenced(self.optimizer):  # this step's hooks ran: not again for the wrapped one
                    self.optimizer.step()
                return loss
            started = time.perf_counter()
            modeled_start = self._modeled_times()
            if modeled_start is not None and not self._scheduler.prefetched:
                self._start_transfer_window()  # else prefetch() started it: its copy-in is this step's first
            stats = SwapStats()
            trace = StepTrace() if self.config.trace else None
            try:
                with self._scheduler.working():  # reads of the state here wait for nothing
                    try:
                        plan = self._step_batches(stats, trace)
                    except torch.OutOfMemoryError as error:
                        if not self._more_batches_after(error):
                            raise
                        stats, trace = SwapStats(), StepTrace() if self.config.trace else None
                        try:
                            plan = self._step_batches(stats, trace)
                        except torch.OutOfMemoryError as again:
                            raise self._still_out_of_memory(again) from again
            finally:
                self._step_grads = []  # zero_grad(set_to_none=True) must be able to free them
                self._journal = None
            self.trace = trace
            note_step_for_lr_schedulers(self.optimizer)
        stats.resident_state_device_bytes = self._resident_bytes
        stats.host_state_bytes = self._store.host_bytes if self._store is not None else 0
        stats.host_pinned_bytes = self._store.host_pinned_bytes if self._store is not None else 0
        stats.peak_state_device_bytes = plan.peak_staging_bytes + self._resident_bytes
        stats.step_seconds = time.perf_counter() - started
        stats.available_device_bytes = self._auto_available if self.config.swap_times == "auto" else None
        if modeled_start is not None:
            _set_modeled_seconds(stats, modeled_start, self._modeled_times())
        self.stats = stats
        return loss

    def _step_batches(self, stats: SwapStats, trace: StepTrace | None) -> SwapPlan:
        """One step's work on the batches (inside ``working()``): follow the user's edits, read the gradients, make
        missing states, plan, run the pipeline; the plan it ran."""
        assert self._scheduler is not None
        ordered = self._ordered_params()
        self._follow_edits(ordered)
        with_grad = self._collect_grads(ordered)
        if self.adapter.lazy_states:
            self._pack_fresh_states(ordered)  # those a failed step left unpacked
        self._journal = self._step_journal()
        self._batches_updated = 0
        plan: SwapPlan | None = None
        try:
            if (self._master_weights or not self.adapter.lazy_states) and not self._states_complete():
                # Lazy states with master weights: the masters, which the update runs on, come first.
                self._create_missing_states(self._params_with_grad())
            plan = self._current_plan()
            if self.adapter.lazy_states and not plan.all_states_exist:
                self._check_room_for_states_the_update_creates()
            # Every parameter has a gradient and a state (the usual step): batches skip per-parameter checks.
            self._every_param_ready = plan.all_states_exist and with_grad == plan.param_count
            skip = self._batches_without_gradients(plan, with_grad)
            # Batches walked in reverse create lazy states out of parameter order: put back in torch's order.
            entries_before = set(map(id, self.state)) if self._reverse_creates_states(plan) else None
            with self.adapter.step_scope():
                if plan.batches:  # an optimizer without parameters steps nothing, as torch's does
                    self._scheduler.run(
                        plan,
                        self._update_batch,
                        stats,
                        keep_staging=self.config.keep_staging,
                        trace=trace,
                        skip=skip,
                    )
        except BaseException as error:
            self._after_failed_step(error, 0 if plan is None else len(plan.batches) + (plan.resident is not None))
            raise
        if entries_before is not None:
            self._tracked.move_to_end(
                param for param in ordered if id(param) not in entries_before and param in self.state
            )
        if self.adapter.lazy_states:
            self._pack_fresh_states(ordered)
        if self._backward_prefetch is not None:
            self._arm_backward_prefetch(after_step=True)
        self._empty_host_cache_after_relayout()
        return plan

    def _still_out_of_memory(self, error: torch.OutOfMemoryError) -> DeviceMemoryError:
        """The error of a step whose retry with twice the batches ran out of device memory too (nothing updated)."""
        assert self.backend is not None
        plan = self._plan
        staging = f"{plan.peak_staging_bytes} bytes of staging" if plan is not None else "its staging"
        return DeviceMemoryError(
            f"swap_times='auto': the device ran out of memory again with {self._auto_floor} batches ({staging}, "
            f"{self.backend.available_device_bytes()} bytes available now): {error}. Nothing was updated. Free "
            "device memory, lower device_memory_fraction (more margin for the rest of the step), keep fewer states "
            "on the device (offload_fraction=1.0, a larger min_numel), or set swap_times to a larger number"
        )

    def _more_batches_after(self, error: torch.OutOfMemoryError) -> bool:
        """With ``swap_times="auto"``, an out-of-memory before any batch updated anything (the staging did not fit):
        plan twice the batches from now on and say so; ``True`` when the step may run again."""
        tried = self._auto_tried
        if self.config.swap_times != "auto" or self._batches_updated or tried is None:
            return False
        batches, most = tried
        if batches >= most:
            return False  # one parameter per batch already
        self._auto_floor = min(2 * batches, most)
        self._plan = None
        warnings.warn(
            f"swap_times='auto': the device ran out of memory staging {batches} batches ({error}); re-planned with "
            f"{self._auto_floor} batches and running the step again. Nothing was updated before the retry",
            ResourceWarning,
            stacklevel=4,
        )
        return True

    def _empty_host_cache_after_relayout(self) -> None:
        """With ``host_memory="caching"``, host buffers a re-layout (or a load, or a reset) replaced stay pinned in
        torch's caching host allocator: give them back once per layout, after the step that dropped the last
        references to them (its plan and any prefetch), so the process pins its layout once, not twice."""
        assert self._store is not None and self.backend is not None
        layout = self._store.layout_id
        if self.config.host_memory == "caching" and layout != self._host_cache_emptied_at:
            self._mirror_check = None  # it may hold the replaced mirrors (it is rebuilt for a new layout anyway)
            self.backend.empty_host_cache()
            self._host_cache_emptied_at = layout

    def _modeled_times(self) -> ModeledTimes | None:
        """The simulator's virtual clock now, when the backend has one."""
        return self.backend.modeled_times() if isinstance(self.backend, SimBackend) else None

    def _start_transfer_window(self) -> None:
        """A step's transfers start here (on the simulator's virtual clock, measured on the copy streams)."""
        if isinstance(self.backend, SimBackend):
            self.backend.start_transfer_window()

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
        if self._scheduler is None or self._scheduler.prefetched:
            return
        with self._scheduler.working():
            self._follow_edits(self._ordered_params())
            plan = self._current_plan()
            if not plan.batches or not plan.batches[0].slots:  # nothing to copy in yet: the first step makes the states
                return
            self._start_transfer_window()
            self._scheduler.prefetch(plan)

    def _prefetch_from_backward(self) -> None:
        """:meth:`prefetch` from a gradient hook: on the stream the steps run on, whatever stream the hook runs under
        (FSDP2 runs post-accumulate-grad hooks under its post-reduce stream: staging allocated there would belong
        to that stream's pool, and the copy-in, ordered after the step's stream only, could overwrite a block the
        reduce-scatter still reads)."""
        assert self._scheduler is not None and self.backend is not None
        with self.backend.stream(self._scheduler.compute):
            self.prefetch()

    @property
    def prefetched(self) -> bool:
        """Whether the next step's first copy-in is already issued (by :meth:`prefetch`, or from the backward with
        ``SwapConfig(prefetch="backward")``); ``False`` again once a step ran."""
        return self._scheduler is not None and self._scheduler.prefetched

    def _reverse_creates_states(self, plan: SwapPlan) -> bool:
        """Whether this step's update may create states (lazy states) while the batches are walked in reverse."""
        return self.adapter.lazy_states and self.config.prefetch == "backward" and not plan.all_states_exist

    def _arm_backward_prefetch(self, *, after_step: bool) -> None:
        """``prefetch="backward"``: the next backward prefetches once the first batch's gradients are final.

        Awaited are the parameters of the batch the next step walks first that had a gradient in the step
        that just ran (``after_step``; before any step: those that require one). See
        :mod:`swap_core.backward_prefetch` for the rules and why an early prefetch stays right.
        """
        assert self._backward_prefetch is not None
        plan = self._current_plan()
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

    def _step_journal(self) -> StepJournal | None:
        """The journal of this step, or ``None``: kept for a step that creates every state it updates (then undoing
        it costs a copy of its parameters only), and for every step with ``SwapConfig(undo_failed_steps=True)``
        (see :mod:`~swap_core.runtime.step_journal`)."""
        undo_every_step = self.config.undo_failed_steps
        if not undo_every_step and self._states_complete():
            return None  # the usual step: no per-parameter scan
        params = [param for _, param in self._params_with_grad()]
        created = [param for param in params if is_fresh(self.state.get(param) or {})]
        if not params or (not undo_every_step and len(created) < len(params)):
            return None
        assert self.backend is not None
        return StepJournal(self.backend, created, keeps_states=undo_every_step)

    def _after_failed_step(self, error: BaseException, batches: int) -> None:
        """A step raised: undo it whole where its journal allows, else say what it applied."""
        journal = self._journal
        if journal is None:
            note_partial_step(error, self._batches_updated, batches)
            return
        assert self._scheduler is not None and self._store is not None and self.backend is not None
        self._scheduler.synchronize()  # every copy of this step has landed: the mirrors may be written
        journal.restore_params()
        for param, saved in journal.saved_states:
            entry = self.state[param]
            slots = self._store.slots.get(param, _NO_ENTRY)
            for key in [key for key in entry if key not in saved]:  # keys the failed update added
                del entry[key]
            for key, value in saved.items():
                if not isinstance(value, torch.Tensor):
                    entry[key] = value
                elif key in slots:  # swapped: back into its host mirror
                    entry[key] = slots[key].host_value
                    with self.backend.host_scope():
                        local_tensor(slots[key].host_value).copy_(value)
                else:
                    local_tensor(entry[key]).copy_(value)
        for param in journal.created:  # the states this step made go, as if it never ran
            if param in self.state:
                del self.state[param]
        self._plan = None

    def _update_batch(self, batch: PlannedBatch) -> None:
        fresh: list[torch.Tensor] = []
        with self._device_states_in_place(batch):
            for group_index, segment_params, segment_states, where in batch.segments:
                grads_in_order = self._step_grads
                segment_grads = (
                    grads_in_order[where] if isinstance(where, slice) else [grads_in_order[i] for i in where]
                )
                if self._every_param_ready:
                    params, states = segment_params, cast("list[dict[str, Any]]", segment_states)
                    grads = cast("list[torch.Tensor]", segment_grads)
                else:
                    params, grads, states = _with_grad(segment_params, segment_grads, segment_states, self._fresh_state)
                    if self.adapter.lazy_states:
                        fresh += [param for param, state in zip(params, states, strict=True) if is_fresh(state)]
                if params:
                    group = self.param_groups[group_index]
                    if self._journal is not None:
                        self._journal.record(params, states)
                    if self._master_weights:  # the update runs on the fp32 masters, the params follow them
                        masters = on_masters(params, grads, states)
                        try:
                            self.adapter.update(
                                UpdateBatch(group, masters.params, masters.grads, masters.states, batch.index, params)
                            )
                        finally:
                            masters.write_back()
                        masters.set_params()
                    else:
                        self.adapter.update(UpdateBatch(group, params, grads, states, batch.index))
        self._batches_updated += 1
        if fresh:
            # States the update just created on the device go to host memory now, before the next batch
            # creates its own (one batch of fresh states on the device at a time).
            self._offload_existing_states(fresh, unpacked=True)
            self._plan = None  # the batches are bound to the entries of state that existed before

    def _fresh_state(self, param: torch.Tensor) -> dict[str, Any]:
        """For an adapter whose update creates states: the entry of ``param``, or an empty dict when it has none.

        The entry is not created here: the optimizer's own step creates it if it keeps a state (plain
        SGD keeps none, and its ``state`` stays empty as torch's does).
        """
        if not self.adapter.lazy_states:
            raise AssertionError("states of parameters with a gradient exist before the pipeline")
        entry: dict[str, Any] = self.state.get(param, {})
        return entry

    def _pack_fresh_states(self, ordered: list[torch.Tensor]) -> None:
        """Pack the host buffers of states created during a step (given buffers of their own meanwhile)."""
        assert self._store is not None and self._scheduler is not None
        if self._store.has_unpacked:
            self._scheduler.synchronize()  # the re-layout reads every host mirror: offloads must be done
            self._store.pack(ordered)
            self._plan = None

    @contextlib.contextmanager
    def _device_states_in_place(self, batch: PlannedBatch) -> Iterator[None]:
        """During its update a batch's ``state`` entries are the device copies; host mirrors again after.

        Swapping entries in place (rather than handing the adapter merged copies)
        keeps whatever the update writes to resident entries, at two dict stores per state.
        """
        for state, slot, view in zip(batch.slot_states, batch.slots, batch.update_views, strict=True):
            state[slot.key] = view
        try:
            yield
        except BaseException:
            for state, slot in zip(batch.slot_states, batch.slots, strict=True):
                state[slot.key] = slot.host_value
            raise
        for state, slot, view in zip(batch.slot_states, batch.slots, batch.update_views, strict=True):
            value = state.get(slot.key)
            if value is not view:  # the update assigned a new tensor instead of writing the state in place
                _take_replaced_state(slot, view, value)
            state[slot.key] = slot.host_value

    def _collect_grads(self, ordered: list[torch.Tensor]) -> int:
        """Read every parameter's gradient once, check it is dense and declare it to the backend.

        The gradients are kept in parameter order (``_step_grads``, dropped when the step ends) for the
        batches to slice. Runs over every parameter in every step, so it stays lean (C-level scans). Returns how
        many parameters have a gradient.
        """
        assert self.backend is not None
        grads: list[torch.Tensor | None] = list(map(_GRAD, ordered))
        self._step_grads = grads
        present = [grad for grad in grads if grad is not None]
        if any(map(_IS_SPARSE, present)):
            index = next(i for i, grad in enumerate(grads) if grad is not None and grad.is_sparse)
            group_index, param = self._ordered_params_with_groups()[index]
            raise RuntimeError(
                f"Parameter {tuple(param.shape)} of param group {group_index} has a sparse gradient; "
                "swapping supports dense gradients only"
            )
        adopt = self.backend.adopt
        for grad in present:
            adopt(grad if type(grad) is torch.Tensor else local_tensor(grad))
        return len(present)

    def _batches_without_gradients(self, plan: SwapPlan, with_grad: int) -> frozenset[int]:
        """Batches no parameter of which has a gradient this step: nothing to update, so nothing to copy (torch's
        step skips such parameters too). None when every parameter has one, or when every batch must run."""
        if with_grad == plan.param_count or plan.walk_every_batch:
            return frozenset()
        grads = self._step_grads
        return frozenset(
            batch.index
            for batch in plan.batches
            if all(
                grad is None
                for _, _, _, where in batch.segments
                for grad in (grads[where] if isinstance(where, slice) else [grads[i] for i in where])
            )
        )

    def _params_with_grad(self) -> list[tuple[int, torch.Tensor]]:
        """``(group index, parameter)`` of the parameters that have a gradient this step (after ``_collect_grads``)."""
        ordered = self._ordered_params_with_groups()
        return [entry for entry, grad in zip(ordered, self._step_grads, strict=True) if grad is not None]

    def _create_missing_states(self, params: Iterable[tuple[int, torch.Tensor]]) -> None:
        """Fresh states of parameters seen with a gradient for the first time, swapped ones born on the host.

        Every ``initial_state`` is asked first, so an adapter that refuses a parameter leaves no
        half-initialized state behind.
        """
        assert self._store is not None
        fresh: list[tuple[torch.Tensor, dict[str, torch.Tensor | StateInit]]]
        if self.adapter.lazy_states:  # its update creates the states: only the masters it runs on are made here
            fresh = [(param, {}) for _, param in params if has_master(param) and not self.state[param]]
        else:
            asked = [
                (param, self.adapter.initial_state(self._as_updated(param), self.param_groups[group_index]))
                for group_index, param in params
                if not self.state[param]
            ]
            # A parameter the adapter keeps no state for (distributed Muon's matrices another rank owns) has nothing
            # to create: left out, it does not make the plan be built again at every step.
            fresh = [
                (param, initial) for param, initial in asked if initial or (self._master_weights and has_master(param))
            ]
        if not fresh:
            return
        self._plan = None
        new: list[tuple[SwapSlot, StateSource]] = []
        try:
            with self._store.all_or_nothing():
                for param, initial in fresh:
                    state = self.state[param]
                    masters = self._master_weights and has_master(param)
                    if masters:  # the master starts as the parameter, exactly (fp32 holds every bf16/fp16 value)
                        initial = {**initial, MASTER_KEY: StateInit(tuple(param.shape), torch.float32)}
                    for key, value in initial.items():
                        state[key] = value
                        if not isinstance(value, StateInit):
                            continue
                        source: StateSource = param.detach() if masters and key == MASTER_KEY else float(value.fill)
                        if self._store.should_swap(key, value):
                            new.append((_slot_for(param, key, value), source))
                        else:
                            state[key] = self._store.resident_value(value, param)
                            if isinstance(source, torch.Tensor):
                                state[key].copy_(source)
                self._store.add(new, self._ordered_params())
        except BaseException:
            for param, _ in fresh:  # each had no state: it has none again (e.g. the host lacked the memory)
                self.state[param].clear()
            raise

    def _current_plan(self) -> SwapPlan:
        assert self._store is not None and self.backend is not None
        key = (self._store.version, self._params_version)
        if self._plan is None or self._plan_key != key:
            params = self._ordered_params_with_groups()
            # Before any batch updates anything: a state the update cannot use fails now, not part-way.
            self._check_states(params, SwapStateError)
            costs = self.adapter.partition_costs([param for _, param in params])
            rank_independent = costs is not None
            if costs is None and self.adapter.lazy_states:
                costs = self._costs_with_fresh_states([param for _, param in params])
            swap_times = self.config.swap_times
            partition = Partition(
                num_batches=1 if swap_times == "auto" else swap_times,
                max_batch_bytes=self.config.max_batch_bytes,
                costs=costs,
                state=self.state,
                resident_first=not rank_independent,
                reverse=self.config.prefetch == "backward",
            )
            if swap_times == "auto":
                store, cut = self._store, partition
                fits_nowhere: DeviceMemoryError | None = None
                try:
                    batches = self._auto_batches(
                        lambda count: staging_bytes(store, params, dataclasses.replace(cut, num_batches=count)),
                        len(params),
                    )
                except DeviceMemoryError as error:
                    if not rank_independent:
                        raise
                    fits_nowhere, batches = error, len(params) + 1  # the others must learn it, not wait for this rank
                if rank_independent:  # every rank walks the same batches: the count that fits every rank
                    batches = self.adapter.agree_on_batches(batches)
                    if batches > len(params):
                        raise fits_nowhere or DeviceMemoryError(
                            "swap_times='auto': another rank's device cannot stage even one parameter per batch "
                            "(its error names the bytes); every rank stops before anything changes"
                        )
                # A rank cannot retry alone with more batches where every rank must walk the same ones.
                self._auto_tried = None if rank_independent else (batches, len(params))
                partition = dataclasses.replace(partition, num_batches=batches)
            self._plan = build_plan(self._store, self.backend, params, partition, walk_every_batch=rank_independent)
            if self.config.swap_times == "auto":
                self._log_auto_choice(self._plan)
            self._plan_key = key
            self._resident_bytes = self._store.resident_bytes(param for _, param in params)
        return self._plan

    def _auto_batches(self, staging_of: Callable[[int], int], most: int) -> int:
        """``swap_times="auto"``: the fewest batches whose staging fits the device memory available now (see
        :mod:`~swap_core.runtime.auto_batches`)."""
        assert self.backend is not None
        available = self.backend.available_device_bytes()
        if available is None:
            raise ValueError(AUTO_NEEDS_MEMORY.format(backend=self.backend.name))
        if self.config.keep_staging and self._plan is not None and self._plan.arenas is not None:
            available += self._plan.arenas.total_bytes  # the arenas it keeps go when the new plan replaces it
        self._auto_available = available
        return fewest_batches_that_fit(
            staging_of, available, self.config.device_memory_fraction, at_least=self._auto_floor, most=most
        )

    def _log_auto_choice(self, plan: SwapPlan) -> None:
        """One log line per choice of ``swap_times="auto"``: batches, staging bytes, device memory available."""
        choice = (len(plan.batches), self._auto_available)
        if choice != self._auto_logged:
            self._auto_logged = choice
            _LOG.info(
                "swap_times='auto': %d batches, staging %d bytes of the %s bytes of device memory available "
                "(device_memory_fraction=%s)",
                len(plan.batches),
                plan.peak_staging_bytes,
                self._auto_available,
                self.config.device_memory_fraction,
            )

    def _check_room_for_states_the_update_creates(self) -> None:
        """States the update is about to create (an adapter whose update makes them): refused before any batch
        updates anything if host memory cannot take them (else the step would fail part-way, after earlier batches
        were updated)."""
        assert self._store is not None
        fresh = [
            (param, key, template)
            for group_index, param in self._params_with_grad()
            if is_fresh(self.state.get(param) or {})
            for key, template in self.adapter.expected_states(
                self._as_updated(param), self.param_groups[group_index]
            ).items()
        ]
        if fresh:
            self._store.check_room_for(fresh, self._ordered_params())

    def _costs_with_fresh_states(self, params: list[torch.Tensor]) -> list[int] | None:
        """Batching costs while some states are still to be created by the update, or ``None`` once none is.

        A state not created yet has no size: the parameter's own bytes stand in for it, so that the
        first step spreads the fresh states over ``swap_times`` batches as later steps spread them.
        """
        assert self._store is not None
        if all(self.state.get(param) for param in params):
            return None
        costs = []
        for param in params:
            slots = self._store.slots.get(param)
            if slots:
                costs.append(sum(slot.nbytes for slot in slots.values()))
            elif self.state.get(param):
                costs.append(0)  # a state without swapped tensors
            else:
                local = local_tensor(param)
                costs.append(local.numel() * local.element_size())
        return costs

    def _states_complete(self) -> bool:
        """Whether every parameter already has its state (then no per-parameter scan is needed)."""
        assert self._store is not None
        plan = self._plan
        if plan is None or self._plan_key != (self._store.version, self._params_version):
            return False
        return plan.all_states_exist

    # -- following what the user did to state and param_groups -------------------
    def _follow_edits(self, ordered: list[torch.Tensor]) -> None:
        """Bring the swap plan in line with what was done to ``param_groups`` and ``state`` since the last look.

        Cheap when nothing changed, as in almost every step: two identity checks, one integer, and one
        C-level pass over the parameter ids and over the swapped entries of ``state``.
        """
        assert self._store is not None and self.backend is not None
        layout = _layout(self.param_groups, ordered)
        layout_changed = layout != self._layout
        if layout_changed:
            _check_distinct_params(self.param_groups)
            select_backend(self.backend, ordered)
            self._params_changed()
            self._layout = layout
        if self.optimizer.state is not self._tracked:
            self._adopt_state()  # the wrapped optimizer's load_state_dict, or `state` assigned
        elif self._tracked.version != self._seen_state_version or not self._mirrors_in_place():
            self._resync_states(ordered)
        elif layout_changed:
            self._store.reorder(ordered)

    def _mirrors_in_place(self) -> bool:
        """Whether every swapped state's entry in ``state`` still is its host mirror."""
        store = self._store
        assert store is not None
        check = self._mirror_check
        if check is None or check[0] != store.version:
            slots = [slot for param_slots in store.slots.values() for slot in param_slots.values()]
            entries = [self.state.get(slot.param, _NO_ENTRY) for slot in slots]
            check = (store.version, entries, [slot.key for slot in slots], [slot.host_value for slot in slots])
            self._mirror_check = check
        _, entries, keys, values = check
        return all(map(operator.is_, map(dict.get, entries, keys), values))

    def _adopt_state(self) -> None:
        """Make the wrapped optimizer's current ``state`` the swapped one: tracked, swapped tensors in host memory.

        All or nothing: if the host cannot hold them, the optimizer is left exactly as it was.
        """
        state = self.optimizer.state
        previous = (self._tracked, self._seen_state_version, self._store, self._mirror_check, self._plan)
        tracked = state if isinstance(state, TrackedState) else TrackedState(state)
        self.optimizer.state = tracked
        self._track(tracked)
        self._seen_state_version = tracked.version
        try:
            self._replace_store(self._new_store(self._swap_keys()))
            self._offload_existing_states(self._ordered_params())
        except BaseException:
            self.optimizer.state = state
            self._tracked, self._seen_state_version, self._store, self._mirror_check, self._plan = previous
            raise

    def _track(self, state: TrackedState) -> None:
        """``state`` is the optimizer's from now on: a read of it from outside the optimizer's work first waits for
        the copies in flight (a user's edit in place between steps must not be overwritten by a copy landing)."""
        assert self._scheduler is not None
        state.before_access = self._scheduler.settle_for_host
        self._tracked = state

    def _replace_store(self, store: StateStore) -> None:
        """A new store: nothing may keep the old one's host memory (or its states' device memory) alive.

        The old host buffers are freed once nothing refers to them: the copies into them are waited for first
        (freeing pinned memory a copy still writes would let the copy write into memory given to others).
        """
        if self._store is not None:
            self.synchronize()
        self._store = store
        self._mirror_check = None
        self._plan = None

    def _resync_states(self, ordered: list[torch.Tensor]) -> None:
        """Entries of ``state`` reset or replaced by hand: their host mirrors give way to what is there now.

        A parameter whose entry is gone or empty starts afresh at its next step, as torch's does; a
        tensor put in place of a host mirror is taken over (copied into host memory).
        """
        assert self._store is not None
        stale = [
            param
            for param, slots in self._store.slots.items()
            if any(self.state.get(param, _NO_ENTRY).get(key) is not slot.host_value for key, slot in slots.items())
        ]
        with self._store.all_or_nothing():
            self._store.remove(stale)
            if not self._offload_existing_states(stale, order=ordered):
                self._store.reorder(ordered)  # nothing was added (which re-packs): re-pack without the removed slots
        self._seen_state_version = self._tracked.version
        self._plan = None  # state dicts are bound to the batches

    def _check_states(
        self,
        params: Sequence[tuple[int, torch.Tensor]],
        error: Callable[[str], Exception],
        *,
        masters_to_make: bool = False,
    ) -> None:
        """Raise ``error`` naming the first parameter whose non-empty state the adapter's update cannot use.

        ``masters_to_make``: a state without a master is to get one (made before wrapping), so only
        the adapter is asked about it.
        """
        for index, (group_index, param) in enumerate(params):
            state = self.state.get(param)
            if not state:
                continue
            problem = None
            if self._master_weights and has_master(param):
                if not (masters_to_make and MASTER_KEY not in state):
                    problem = master_problem(param, state)
                state = without_master(state)
            if problem is None:
                problem = self.adapter.state_mismatch(self._as_updated(param), self.param_groups[group_index], state)
            if problem is not None:
                raise error(
                    f"The state of parameter {index} (param group {group_index}, shape {tuple(param.shape)}) "
                    f"{problem}: {type(self.optimizer).__name__}'s update cannot use it, and nothing was changed. "
                    "Load a complete checkpoint, or reset the entry (del optimizer.state[param]) to start it afresh"
                )

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
        if _overrides(self.optimizer, "state_dict"):
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
        if self._store is None:
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
        self._follow_edits(self._ordered_params())
        self._create_missing_states(
            (group_index, param) for group_index, param in self._ordered_params_with_groups() if param.requires_grad
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
        if self._store is not None:
            self.synchronize()
        # The load hooks run once, given this wrapper, on every path; the wrapped optimizer's own load_state_dict
        # (CPU parameters, or a class with its own) would run the same (shared) hooks given itself: set aside.
        state_dict = state_dict.copy() if isinstance(state_dict, dict) else dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        with hook_registries_set_aside(self.optimizer, _LOAD_HOOK_DICTS):
            if self._store is None:
                self.optimizer.load_state_dict(dict(self.adapter.import_state_dict(state_dict)))
            elif _overrides(self.optimizer, "load_state_dict"):
                # Its own format and casting rules (bitsandbytes keeps uint8 codes uint8): its own method loads, and
                # the loaded state is then taken over into host memory, as after a load through the wrapped optimizer.
                with params_as_masters(self.optimizer) if self._master_weights else contextlib.nullcontext():
                    self.optimizer.load_state_dict(dict(self.adapter.import_state_dict(state_dict)))
                self._follow_edits(self._ordered_params())
                if self._master_weights:
                    self._make_masters_of_existing_states(_PLAIN_CHECKPOINT, stacklevel=3)
            else:
                self._load_swapped(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _make_masters_of_existing_states(self, warning: str, *, stacklevel: int) -> None:
        """States without masters (made before wrapping, or loaded by the optimizer's own method): masters from params.

        An optimizer stepped before wrapping, or one whose constructor makes states (Adagrad's ``sum``),
        holds states in the parameters' dtype. They are taken as a checkpoint saved without master
        weights is loaded: the master starts as the parameter, the states are kept in fp32 (exact
        where the parameter's dtype held their values exactly, as zeros). ``warning`` (formatted with
        ``count``) says so once.
        """
        lacking = [
            param
            for param in self._ordered_params()
            if has_master(param) and self.state.get(param) and MASTER_KEY not in self.state[param]
        ]
        if not lacking:
            return
        with hook_registries_set_aside(self.optimizer, _STATE_DICT_HOOK_DICTS):
            plain = torch.optim.Optimizer.state_dict(self.optimizer)
        self._load_swapped(plain, warn_of_made_masters=False)
        warnings.warn(
            warning.format(count=len(lacking), name=type(self.optimizer).__name__), UserWarning, stacklevel=stacklevel
        )

    def _load_swapped(self, state_dict: Mapping[str, Any], *, warn_of_made_masters: bool = True) -> None:
        """Stage ``state_dict`` in host memory, checked completely, then commit it (the swapped path)."""
        assert self._store is not None
        ordered = self._ordered_params()
        self._follow_edits(ordered)
        state_dict = self.adapter.import_state_dict(state_dict)
        store = self._new_store(self._swap_keys())
        staged = load_swapped_state(
            self.param_groups, self.adapter, store, state_dict, master_weights=self._master_weights
        )
        groups, state, loaded = staged.param_groups, staged.state, staged.swapped
        if staged.masters_from_params and warn_of_made_masters:
            warnings.warn(_PLAIN_CHECKPOINT.format(count=staged.masters_from_params), UserWarning, stacklevel=3)
        if staged.low_precision_masters:
            warnings.warn(_LOW_PRECISION_MASTERS.format(count=staged.low_precision_masters), UserWarning, stacklevel=3)
        if self._store.load_in_place(loaded, state):
            # The loaded layout is the live one (a resume): the mirrors took the values, nothing was allocated.
            store = self._store
            self._plan = None  # the batches and the mirror check hold the old state's entries
            self._mirror_check = None
        else:
            store.attach(state)
            store.add(loaded, ordered)
            self._replace_store(store)
        # Finish as torch's load_state_dict does: the wrapped optimizer's __setstate__ fills option
        # defaults missing from older checkpoints (and AdamW forces decoupled weight decay).
        self.optimizer.__setstate__({"state": state, "param_groups": groups})
        self._track(state)
        self._seen_state_version = state.version
        self._layout = _layout(self.param_groups, ordered)
        store.attach(self.state)

    # -- parameters -----------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its states are created and swapped on its first step."""
        if not hasattr(self, "optimizer"):  # torch's Optimizer machinery may call this before __init__ ends
            raise RuntimeError("SwapOptimizer is not initialized")
        param_group["params"] = _group_params(param_group)  # as torch's add_param_group does (a generator once)
        _check_distinct_params([*self.param_groups, param_group])
        if self._master_weights:
            self._check_master_weights_supported(param_group["params"])
        if self.backend is None:
            self.optimizer.add_param_group(param_group)
            return
        select_backend(self.backend, [*self._ordered_params(), *param_group["params"]])
        self.synchronize()
        self.optimizer.add_param_group(param_group)
        self._follow_edits(self._ordered_params())

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
        if self._store is None:
            self.adapter.params_changed(self._ordered_params())
            return
        self._layout = ([], [])  # re-plan even when the order looks unchanged
        self._follow_edits(self._ordered_params())

    def _rebind(self, new_to_old_param: Mapping[torch.Tensor, torch.Tensor]) -> None:
        current = {id(param) for param in self._ordered_params()}
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
        if self._store is not None:
            self._store.rekey(new_to_old_param)

    def _params_changed(self) -> None:
        if self._master_weights:
            self._check_master_weights_supported(self._ordered_params())
        self.adapter.params_changed(self._ordered_params())  # may refuse: nothing has changed yet
        self._params_version += 1
        self._plan = None
        if self.backend is not None:
            self._adopt_params()

    # -- helpers ----------------------------------------------------------------
    def _as_updated(self, param: torch.Tensor) -> torch.Tensor:
        """What the update runs on, as the adapter is asked about it: an fp32 stand-in for a master's parameter."""
        return stand_in(param) if self._master_weights and has_master(param) else param

    def _check_master_weights_supported(self, params: Sequence[torch.Tensor]) -> None:
        """``master_weights=True`` where this release cannot keep its promise: refused before anything changes.

        Only parameters that get a master count; with none (fp32 parameters only) there is nothing to refuse.
        """
        low = [param for param in params if has_master(param)]
        if not low:
            _LOG.info("master_weights=True, but no parameter is bfloat16 or float16: no master copy is made")
            return
        name = type(self.optimizer).__name__
        reason = self.adapter.master_weights_unsupported
        if reason is not None:
            raise UnsupportedOptimizerError(
                f"master_weights=True is not supported yet for {name} through {type(self.adapter).__name__}: "
                f"{reason}. Adam, AdamW, RMSprop, Muon and the optimizers swap-generic runs support "
                "it (FSDP2 and HSDP included), or keep master_weights=False"
            )

    def _ordered_params_with_groups(self) -> list[tuple[int, torch.Tensor]]:
        return [(index, param) for index, group in enumerate(self.param_groups) for param in group["params"]]

    def _ordered_params(self) -> list[torch.Tensor]:
        return [param for group in self.param_groups for param in group["params"]]

    def _adopt_params(self) -> None:
        assert self.backend is not None
        for param in self._ordered_params():
            self.backend.adopt(local_tensor(param))

    def _swap_keys(self) -> tuple[str, ...] | None:
        """The state keys to swap (``None``: any), the requested ones checked against those the optimizer creates:
        a typo (``"momentum"`` for ``"momentum_buffer"``) would otherwise swap nothing, silently."""
        declared = self.adapter.swappable_keys
        # A family that swaps any key may still know the ones its optimizer creates (swap-generic's probe).
        known = tuple(sorted(self.adapter.created_keys)) if declared is None and self.adapter.created_keys else declared
        if known is not None and self.config.master_weights:
            known = (*known, MASTER_KEY)
        requested = self.config.state_keys
        if requested is None:
            return None if declared is None else known
        unknown = [key for key in requested if known is not None and key not in known]
        if unknown:
            valid = list(known or ())
            raise ValueError(
                f"Unknown state_keys {unknown} for {type(self.optimizer).__name__}; swappable keys are {valid}"
            )
        return requested

    def _new_store(self, swap_keys: tuple[str, ...] | None) -> StateStore:
        assert self.backend is not None and self._scheduler is not None
        return StateStore(
            self.backend,
            self.state,
            swap_keys=swap_keys,
            min_numel=self.config.min_numel,
            # CPU parameters in master-weights mode: the runtime runs for the master math, host memory is the device's.
            offload_fraction=0.0 if isinstance(self.backend, CpuBackend) else self.config.offload_fraction,
            packed=self.config.packed,
            copy_stream=self._scheduler.d2h,
            await_offloads=self._scheduler.synchronize,
            host_memory=self.config.host_memory,
        )

    def _offload_existing_states(
        self, params: Iterable[torch.Tensor], order: Sequence[torch.Tensor] | None = None, *, unpacked: bool = False
    ) -> int:
        """Existing state tensors of ``params`` move to host memory now; returns how many.

        They were created or loaded before wrapping, put in place of a host mirror by hand, or created
        by the update of a step (``unpacked``: packed later, see :meth:`StateStore.add`).
        """
        assert self._store is not None
        new: list[tuple[SwapSlot, StateSource]] = []
        for param in params:
            swapped = self._store.slots.get(param, _NO_ENTRY)  # e.g. the master, made before the update
            for key, value in self.state.get(param, _NO_ENTRY).items():
                if key in swapped:
                    continue
                if isinstance(value, torch.Tensor) and self._store.should_swap(key, value):
                    new.append((_slot_like(value, key, value.dtype, param=param), value))
        self._store.add(new, self._ordered_params() if order is None else order, unpacked=unpacked)
        return len(new)


def _set_modeled_seconds(stats: SwapStats, start: ModeledTimes, end: ModeledTimes | None) -> None:
    """``stats.modeled_step_seconds`` from the virtual clock at entry and at exit; ``modeled_transfer_seconds`` on
    the copy streams: from the start of the step's first copy (a ``prefetch()``'s, if it ran one) to the end of
    its last."""
    assert end is not None
    entered = max(start.host, start.compute)
    stats.modeled_step_seconds = max(end.compute - entered, 0.0)
    first = end.transfers_started
    stats.modeled_transfer_seconds = max(end.transfers - first, 0.0) if first is not None else 0.0


def _with_grad(
    params: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    states: list[dict[str, Any] | None],
    missing_state: Callable[[torch.Tensor], dict[str, Any]],
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[dict[str, Any]]]:
    """The parameters of a batch segment that have a gradient this step, with their gradients and states
    (``missing_state(param)`` for one that had no entry when the plan was made)."""
    kept_params, kept_grads, kept_states = [], [], []
    for param, grad, state in zip(params, grads, states, strict=True):
        if grad is None:
            continue
        if state is None:
            state = missing_state(param)
        kept_params.append(param)
        kept_grads.append(grad)
        kept_states.append(state)
    return kept_params, kept_grads, kept_states


def _overrides(optimizer: torch.optim.Optimizer, method: str) -> bool:
    """Whether ``optimizer``'s class replaces ``torch.optim.Optimizer``'s ``method`` with one of its own."""
    return getattr(type(optimizer), method) is not getattr(torch.optim.Optimizer, method)


def _take_replaced_state(slot: SwapSlot, view: torch.Tensor, value: object) -> None:
    """The update put a new tensor where a swapped state's device copy was: the copy takes its values."""
    local = local_tensor(value) if isinstance(value, torch.Tensor) else None
    device_copy = local_tensor(view)
    if local is None or local.shape != device_copy.shape or local.dtype != device_copy.dtype:
        found = f"a {tuple(local.shape)} {local.dtype} tensor" if local is not None else repr(value)
        raise SwapStateError(
            f"The update replaced swapped state {slot.key!r} ({tuple(device_copy.shape)} {device_copy.dtype}) by "
            f"{found}: a swapped state must keep its shape and dtype. Keep this key on the device "
            "(SwapConfig(state_keys=...) without it)"
        )
    device_copy.copy_(local)


_NO_ENTRY: dict[str, Any] = {}
"""What a parameter without an entry in ``state`` holds (never written to)."""


def _layout(groups: Sequence[Mapping[str, Any]], ordered: Sequence[torch.Tensor]) -> Layout:
    return list(map(id, ordered)), [len(group["params"]) for group in groups]


def _check_not_wrapped(optimizer: torch.optim.Optimizer) -> None:
    reference = _WRAPPERS.get(optimizer)
    if reference is not None and reference() is not None:
        raise UnsupportedOptimizerError(
            f"This {type(optimizer).__name__} is already wrapped by a SwapOptimizer: step that one. A second wrapper "
            "would keep a second copy of the state in host memory, and the two would diverge silently"
        )


def _check_state_assignable(optimizer: torch.optim.Optimizer) -> None:
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


def _check_distinct_params(groups: Sequence[Mapping[str, Any]]) -> None:
    """Every parameter once: torch would update a repeated one twice per step (and warns that it will refuse)."""
    first_seen: dict[int, tuple[int, int]] = {}
    for group_index, group in enumerate(groups):
        for position, param in enumerate(_group_params(group)):
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


def _remove_swap_hooks(optimizer: torch.optim.Optimizer) -> None:
    for name in HOOK_REGISTRIES:
        hooks = optimizer.__dict__.get(name, {})
        for handle in [handle for handle, hook in hooks.items() if getattr(hook, "_swap_core_hook", False)]:
            del hooks[handle]


def _tagged(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a hook as swap's own, so that wrapping the same optimizer again replaces it instead of adding one."""
    hook._swap_core_hook = True  # type: ignore[attr-defined]
    return hook


def _synchronized(wrapper: SwapOptimizer) -> Callable[[torch.optim.Optimizer], None]:
    """State-dict pre-hook: every offload finished before the host mirrors are read (weakly bound)."""
    reference = weakref.ref(wrapper)

    def synchronize(optimizer: torch.optim.Optimizer) -> None:
        live = reference()
        if live is not None:
            live.synchronize()

    return _tagged(synchronize)


def _exported(adapter: StateSwapAdapter) -> Callable[[torch.optim.Optimizer, dict[str, Any]], dict[str, Any]]:
    """State-dict post-hook: the adapter's checkpoint form of the state (see ``export_state_dict``)."""
    return _tagged(functools.partial(_export_state_dict, adapter))


def _export_state_dict(
    adapter: StateSwapAdapter, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> dict[str, Any]:
    return adapter.export_state_dict(state_dict)


def _slot_for(param: torch.Tensor, key: str, init: StateInit) -> SwapSlot:
    """A slot for a fresh state: a shard like ``param``'s, or a whole tensor this rank holds alone."""
    if init.shard_like_param:
        return _slot_like(param, key, init.dtype)
    return SwapSlot(param, key, torch.Size(init.shape), init.dtype)


def _slot_like(like: torch.Tensor, key: str, dtype: torch.dtype, *, param: torch.Tensor | None = None) -> SwapSlot:
    """A slot for state ``key`` shaped, laid out and sharded like ``like``; bytes are always the local shard's.

    Laid out like ``like`` as torch's ``zeros_like(p, memory_format=torch.preserve_format)`` is: a fused
    kernel reads a state in memory order, so a channels-last parameter's moments must be channels-last.
    """
    local = local_tensor(like)
    owner = param if param is not None else like
    return SwapSlot(owner, key, local.shape, dtype, shard_layout(like), layout_stride(local))


def _group_params(param_group: Mapping[str, Any]) -> list[torch.Tensor]:
    params = param_group.get("params", [])
    if isinstance(params, torch.Tensor):
        return [params]
    return list(params)


class _OutsideStepRedirect:
    """The wrapped optimizer's own ``eval`` (say): runs its wrapper's :meth:`SwapOptimizer.outside_step`.

    Without a live wrapper (a deep copy of the wrapped optimizer, or one whose wrapper is gone) it runs the
    class's method, as the plain optimizer would.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, name: str) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        optimizer = self._optimizer()
        if optimizer is None:
            raise ReferenceError(f"the optimizer of this {self._name}() is gone")
        reference = _WRAPPERS.get(optimizer)
        wrapper = reference() if reference is not None else None
        if wrapper is None or wrapper.optimizer is not optimizer:
            return getattr(type(optimizer), self._name)(optimizer, *args, **kwargs)
        return wrapper.outside_step(self._name, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _OutsideStepRedirect:
        optimizer = self._optimizer()
        if optimizer is None:
            return self
        return _OutsideStepRedirect(memo.get(id(optimizer), optimizer), self._name)


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
