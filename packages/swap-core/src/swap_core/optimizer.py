"""``SwapOptimizer``: a torch optimizer whose states live in host memory between steps.

Orchestration only: prepare (create missing states) -> partition (cached plan)
-> pipeline (prefetch / update / offload) -> finish (stats). Where states live
is the :class:`~swap_core.runtime.store.StateStore`'s business, how they move
is the :class:`~swap_core.runtime.pipeline.PipelineScheduler`'s, and how a batch
is updated is the adapter's.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import torch

from .adapters.base import AdapterFactory, StateInit, StateSwapAdapter, UpdateBatch
from .backend_selection import select_backend
from .backends.protocol import DeviceBackend
from .config import SwapConfig
from .runtime.dtensor import local_tensor, shard_layout
from .runtime.pipeline import PipelineScheduler
from .runtime.plan import PlannedBatch, SwapPlan, build_plan
from .runtime.slots import SwapSlot
from .runtime.store import StateSource, StateStore
from .state_dict_loading import load_swapped_state
from .stats import SwapStats
from .trace import StepTrace

__all__ = ["SwapOptimizer"]

_AMP_ATTRIBUTES = ("grad_scale", "found_inf")
_GRAD = operator.attrgetter("grad")
_IS_SPARSE = operator.attrgetter("is_sparse")


class SwapOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` so that its states stream through the device during :meth:`step`.

    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own
    objects, so LR schedulers, gradient clipping and hooks see one optimizer.
    Between steps every swapped state in ``state`` is a host tensor; call
    :meth:`synchronize` before reading it directly (``state_dict()`` does).
    """

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
        self._init_hooks()
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.config = config
        self.adapter: StateSwapAdapter = adapter_factory(optimizer)
        self.stats = SwapStats()
        self.trace: StepTrace | None = None
        """The pipeline timeline of the last step when ``config.trace`` is on."""
        # GradScaler hands fused optimizers grad_scale/found_inf as attributes; step() forwards them.
        self._step_supports_amp_scaling = getattr(optimizer, "_step_supports_amp_scaling", False)
        self.backend: DeviceBackend | None = select_backend(config.backend, self._ordered_params())
        self._plan: SwapPlan | None = None
        self._plan_key: tuple[int, int] | None = None
        self._params_version = 0
        self._resident_bytes = 0
        self._all_states_exist = False
        self._plan_params = 0
        self._every_param_ready = False
        self._step_grads: list[torch.Tensor | None] = []
        swap_keys = self._swap_keys()
        # First post-hook: user hooks (registered later) see the checkpoint form of the state dict.
        self.register_state_dict_post_hook(_export_state_dict)
        if self.backend is None:
            self._scheduler: PipelineScheduler | None = None
            self._store: StateStore | None = None
            return
        self._scheduler = PipelineScheduler(self.backend, duplex=config.duplex)
        self._store = self._new_store(swap_keys)
        self._adopt_params()
        self._offload_existing_states()

    def _init_hooks(self) -> None:
        # What torch.optim.Optimizer.__init__ sets up, without re-adding the wrapped optimizer's groups.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

    def __repr__(self) -> str:
        backend = self.backend.name if self.backend is not None else "none (CPU parameters)"
        return f"SwapOptimizer({self.optimizer!r}, backend={backend}, config={self.config!r})"

    # -- step -----------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update every parameter with a gradient; swapped states stream through the device."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with self._amp_attributes_forwarded():
            if self._scheduler is None:
                self.optimizer.step()
                return loss
            started = time.perf_counter()
            stats = SwapStats()
            trace = StepTrace() if self.config.trace else None
            try:
                with_grad = self._collect_grads()
                if not self._states_complete():
                    self._create_missing_states(self._params_with_grad())
                plan = self._current_plan()
                # Every parameter has a gradient and a state (the usual step): batches skip per-parameter checks.
                self._every_param_ready = self._all_states_exist and with_grad == self._plan_params
                self._scheduler.run(plan, self._update_batch, stats, keep_staging=self.config.keep_staging, trace=trace)
            finally:
                self._step_grads = []  # zero_grad(set_to_none=True) must be able to free them
            self.trace = trace
        stats.resident_state_device_bytes = self._resident_bytes
        stats.host_state_bytes = self._store.host_bytes if self._store is not None else 0
        stats.peak_state_device_bytes = plan.peak_staging_bytes + self._resident_bytes
        stats.step_seconds = time.perf_counter() - started
        self.stats = stats
        return loss

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

    def _update_batch(self, batch: PlannedBatch) -> None:
        with self._device_states_in_place(batch):
            for group_index, segment_params, segment_states, start in batch.segments:
                segment_grads = self._step_grads[start : start + len(segment_params)]
                if self._every_param_ready:
                    params, states = segment_params, cast("list[dict[str, Any]]", segment_states)
                    grads = cast("list[torch.Tensor]", segment_grads)
                else:
                    params, grads, states = _with_grad(segment_params, segment_grads, segment_states)
                if params:
                    group = self.param_groups[group_index]
                    self.adapter.update(UpdateBatch(group, params, grads, states, batch.index))

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
        finally:
            for state, slot in zip(batch.slot_states, batch.slots, strict=True):
                state[slot.key] = slot.host_value

    def _collect_grads(self) -> int:
        """Read every parameter's gradient once, check it is dense and declare it to the backend.

        The gradients are kept in parameter order (``_step_grads``, dropped when the step ends) for the
        batches to slice. Runs over every parameter in every step, so it stays lean (C-level scans). Returns how
        many parameters have a gradient.
        """
        assert self.backend is not None
        grads: list[torch.Tensor | None] = list(map(_GRAD, self._ordered_params()))
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
        fresh = [
            (param, self.adapter.initial_state(param, self.param_groups[group_index]))
            for group_index, param in params
            if not self.state[param]
        ]
        new: list[tuple[SwapSlot, StateSource]] = []
        for param, initial in fresh:
            state = self.state[param]
            for key, value in initial.items():
                state[key] = value
                if not isinstance(value, StateInit):
                    continue
                if self._store.should_swap(key, value):
                    new.append((_slot_for(param, key, value), float(value.fill)))
                else:
                    state[key] = self._store.resident_value(value, param)
            self._plan = None
        self._store.add(new, self._ordered_params())

    def _current_plan(self) -> SwapPlan:
        assert self._store is not None and self.backend is not None
        key = (self._store.version, self._params_version)
        if self._plan is None or self._plan_key != key:
            params = self._ordered_params_with_groups()
            costs = self.adapter.partition_costs([param for _, param in params])
            self._plan = build_plan(
                self._store,
                self.backend,
                params,
                num_batches=self.config.swap_times,
                max_batch_bytes=self.config.max_batch_bytes,
                costs=costs,
            )
            self._plan_key = key
            self._resident_bytes = self._store.resident_bytes(param for _, param in params)
            start = 0  # batches are consecutive runs of the parameters in order
            for batch in self._plan.batches:
                # .get: binding must not create entries (torch keeps no state for never-updated params).
                batch.segments = []
                for group_index, grouped in itertools.groupby(batch.params, key=lambda entry: entry[0]):
                    members = [param for _, param in grouped]
                    states = [self.state.get(param) for param in members]
                    batch.segments.append((group_index, members, states, start))
                    start += len(members)
                batch.slot_states = [self.state[slot.param] for slot in batch.slots]
            assert start == len(params), "the batches cover every parameter once, in order"
            self._plan_params = len(params)
            self._all_states_exist = all(
                state for batch in self._plan.batches for _, _, states, _ in batch.segments for state in states
            )
        return self._plan

    def _states_complete(self) -> bool:
        """Whether every parameter already has its state (then no per-parameter scan is needed)."""
        assert self._store is not None
        current = self._plan is not None and self._plan_key == (self._store.version, self._params_version)
        return current and self._all_states_exist

    # -- synchronization and state dicts -------------------------------------
    def synchronize(self) -> None:
        """Block until every offload has finished, so host mirrors in ``state`` are current."""
        if self._scheduler is not None:
            self._scheduler.synchronize()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()``, exactly, with swapped states as host tensors.

        Swapped tensors are the host mirrors themselves (no device copy, no extra
        host copy), so the result loads into a plain optimizer, whose
        ``load_state_dict`` moves them to the parameters' device, and
        ``torch.load(..., weights_only=True)`` reads a saved one.
        """
        self.synchronize()
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
        self.synchronize()
        self._create_missing_states(
            (group_index, param) for group_index, param in self._ordered_params_with_groups() if param.requires_grad
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict of this optimizer's family, swapped states straight into host memory.

        Casting follows ``torch.optim.Optimizer.load_state_dict`` (floating states
        take the parameter's dtype, ``step`` is kept). The checkpoint is checked
        and staged completely before anything is replaced, so a mismatch raises
        :class:`~swap_core.errors.StateDictMismatchError` with the state intact.
        """
        if self._store is None:
            self.optimizer.load_state_dict(dict(self.adapter.import_state_dict(state_dict)))
            return
        self.synchronize()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, dict(state_dict))
            if result is not None:
                state_dict = result
        state_dict = self.adapter.import_state_dict(state_dict)
        store = self._new_store(self._swap_keys())
        groups, state = load_swapped_state(self, store, state_dict, self._ordered_params())
        self._store = store
        # Finish as torch's load_state_dict does: the wrapped optimizer's __setstate__ fills option
        # defaults missing from older checkpoints (and AdamW forces decoupled weight decay).
        self.optimizer.__setstate__({"state": state, "param_groups": groups})
        self.state = self.optimizer.state
        self.param_groups = self.optimizer.param_groups
        store.attach(self.state)
        self._plan = None
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # -- parameters -----------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its states are created and swapped on its first step."""
        if not hasattr(self, "optimizer"):  # torch's Optimizer machinery may call this before __init__ ends
            raise RuntimeError("SwapOptimizer is not initialized")
        if self.backend is not None:
            select_backend(self.backend, [*self._ordered_params(), *_group_params(param_group)])
        self.optimizer.add_param_group(param_group)
        self._params_changed()

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
        self._params_changed()
        if self._store is not None:
            self._store.reorder(self._ordered_params())

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
        self._params_version += 1
        self._plan = None
        if self.backend is not None:
            self._adopt_params()

    # -- helpers ----------------------------------------------------------------
    def _ordered_params_with_groups(self) -> list[tuple[int, torch.Tensor]]:
        return [(index, param) for index, group in enumerate(self.param_groups) for param in group["params"]]

    def _ordered_params(self) -> list[torch.Tensor]:
        return [param for group in self.param_groups for param in group["params"]]

    def _adopt_params(self) -> None:
        assert self.backend is not None
        for param in self._ordered_params():
            self.backend.adopt(local_tensor(param))

    def _swap_keys(self) -> tuple[str, ...]:
        declared = self.adapter.swappable_keys
        requested = self.config.state_keys
        if requested is None:
            return declared
        unknown = [key for key in requested if key not in declared]
        if unknown:
            raise ValueError(
                f"Unknown state_keys {unknown} for {type(self.optimizer).__name__}; swappable keys are {list(declared)}"
            )
        return requested

    def _new_store(self, swap_keys: tuple[str, ...]) -> StateStore:
        assert self.backend is not None and self._scheduler is not None
        return StateStore(
            self.backend,
            self.state,
            swap_keys=swap_keys,
            min_numel=self.config.min_numel,
            offload_fraction=self.config.offload_fraction,
            packed=self.config.packed,
            copy_stream=self._scheduler.d2h,
        )

    def _offload_existing_states(self) -> None:
        """States created before wrapping (e.g. loaded into the plain optimizer) move to host memory now."""
        assert self._store is not None
        new: list[tuple[SwapSlot, StateSource]] = []
        for param in self._ordered_params():
            for key, value in self.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and self._store.should_swap(key, value):
                    new.append((_slot_like(value, key, value.dtype, param=param), value))
        self._store.add(new, self._ordered_params())


def _with_grad(
    params: list[torch.Tensor], grads: list[torch.Tensor | None], states: list[dict[str, Any] | None]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[dict[str, Any]]]:
    """The parameters of a batch segment that have a gradient this step, with their gradients and states."""
    kept_params, kept_grads, kept_states = [], [], []
    for param, grad, state in zip(params, grads, states, strict=True):
        if grad is None:
            continue
        assert state is not None, "states of parameters with a gradient exist before the pipeline"
        kept_params.append(param)
        kept_grads.append(grad)
        kept_states.append(state)
    return kept_params, kept_grads, kept_states


def _export_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """State-dict post-hook: the adapter's checkpoint form of the state (see ``export_state_dict``)."""
    assert isinstance(optimizer, SwapOptimizer)
    return optimizer.adapter.export_state_dict(state_dict)


def _slot_for(param: torch.Tensor, key: str, init: StateInit) -> SwapSlot:
    """A slot for a fresh state: a shard like ``param``'s, or a whole tensor this rank holds alone."""
    if init.shard_like_param:
        return _slot_like(param, key, init.dtype)
    return SwapSlot(param, key, torch.Size(init.shape), init.dtype)


def _slot_like(like: torch.Tensor, key: str, dtype: torch.dtype, *, param: torch.Tensor | None = None) -> SwapSlot:
    """A slot for state ``key`` shaped (and sharded) like ``like``; bytes are always the local shard's."""
    return SwapSlot(param if param is not None else like, key, local_tensor(like).shape, dtype, shard_layout(like))


def _group_params(param_group: Mapping[str, Any]) -> list[torch.Tensor]:
    params = param_group.get("params", [])
    if isinstance(params, torch.Tensor):
        return [params]
    return list(params)
