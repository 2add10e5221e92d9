"""What a :class:`~swap_core.SwapOptimizer` swaps with, made once at wrapping: :class:`Swapped` where a backend swaps
the states, :class:`NothingSwapped` where none does (CPU parameters with ``backend="auto"``: the wrapped optimizer
steps alone, with the same results). The torch face asks either the same questions and never checks which it has.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..adapters.base import StateSwapAdapter
from ..backend_selection import select_backend
from ..backends.protocol import DeviceBackend, ModeledTimes
from ..config import SwapConfig
from ..master_weights.policy import Masters
from ..runtime.pipeline import PipelineScheduler, drain_in_flight_copies
from ..runtime.plan import SwapPlan
from ..runtime.store import HostLayout
from ..stats import SwapStats, link_bytes_per_second
from ..torch_compat import step_hooks_silenced
from .loading import STATES_BEFORE_WRAPPING, load_state_dict, make_masters_of_existing_states
from .plan_cache import PlanCache
from .setup import SwapSetup, decide_setup
from .state_sync import StateSync
from .step_driver import StepDriver, StepOutcome
from .wrapping import ordered_params

__all__ = ["NothingSwapped", "Swapped", "start_swapping"]

_LOG = logging.getLogger("swap_core")

NOTHING_SWAPPED = "This SwapOptimizer swaps nothing (its parameters are on the CPU, backend='auto')"


def start_swapping(
    owner: torch.optim.Optimizer,
    optimizer: torch.optim.Optimizer,
    adapter: StateSwapAdapter,
    config: SwapConfig,
    masters: Masters,
    backend: DeviceBackend | None,
    driver_type: type[StepDriver],
) -> Swapped | NothingSwapped:
    """Take over ``optimizer``'s states for ``owner`` (its wrapper) on ``backend``: the setup decided, the host
    mirrors, masters, its step driver (``driver_type``, the one of ``config.step``); or nothing, without a backend."""
    if backend is None:
        return NothingSwapped(optimizer, adapter)
    driver_type.check_supported(adapter, ordered_params(optimizer.param_groups))
    setup = decide_setup(optimizer, adapter, config, backend, masters, driver_type)
    # Copies in flight are waited for when the wrapper is collected, before its host buffers go.
    finalizer = weakref.finalize(owner, drain_in_flight_copies, setup.scheduler)
    sync = StateSync(optimizer, adapter, setup.scheduler, setup.store_options, masters)
    plans = PlanCache(setup, sync)
    sync.start()  # existing states move to host memory (may find the host too small)
    make_masters_of_existing_states(sync, adapter, STATES_BEFORE_WRAPPING)
    driver = driver_type(owner, setup, sync, plans)
    finalizer.detach()  # what the driver lets go of comes first (a step still open is taken back), then the copies
    weakref.finalize(owner, _collected, setup.scheduler, driver.what_goes_when_collected())
    return Swapped(setup, sync, plans, driver)


def _collected(scheduler: PipelineScheduler, letting_go: list[Callable[[], object]]) -> None:
    """Finalizer of a swapped optimizer: what its driver holds on to goes (hooks removed, a step still open taken
    back; none of it holds the optimizer), then the copies it left in flight are waited for before its host buffers
    go (:func:`drain_in_flight_copies`). A failure cannot be raised from a finalizer: it is logged."""
    for let_go in letting_go:
        try:
            let_go()
        except Exception as error:
            _LOG.warning("Could not let go of a collected swapped optimizer's step (%s)", error)
    drain_in_flight_copies(scheduler)


class Swapped:
    """A backend swaps the states: the setup, the followed state, the plans and the step driver."""

    def __init__(self, setup: SwapSetup, sync: StateSync, plans: PlanCache, driver: StepDriver) -> None:
        self.setup = setup
        self.sync = sync
        self.plans = plans
        self.driver = driver

    @property
    def claims_amp_scaling(self) -> bool:
        """Whether ``GradScaler`` is to hand the step its scale (which the driver then refuses)."""
        return self.driver.claims_amp_scaling

    def is_capturing(self) -> bool:
        return self.setup.backend.is_capturing()

    def open_transfer_window(self) -> ModeledTimes | None:
        """On a virtual clock: its times as ``step()`` begins (the step's transfer window opened here unless a copy
        began it before); ``None`` without one."""
        backend = self.setup.backend
        start = backend.modeled_times()
        if start is not None and not self.driver.transfers_started:
            backend.start_transfer_window()
        return start

    def close_transfer_window(self, stats: SwapStats, start: ModeledTimes | None) -> None:
        """``stats.modeled_step_seconds`` from the virtual clock at entry and at exit; ``modeled_transfer_seconds`` on
        the copy streams: from the start of the step's first copy (a ``prefetch()``'s, if it ran one) to the end of
        its last; ``link_bytes_per_second``, the step's bytes over that window."""
        if start is None:
            return
        end = self.setup.backend.modeled_times()
        assert end is not None
        entered = max(start.host, start.compute)
        stats.modeled_step_seconds = max(end.compute - entered, 0.0)
        first = end.transfers_started
        stats.modeled_transfer_seconds = max(end.transfers - first, 0.0) if first is not None else 0.0
        moved = stats.h2d_bytes + stats.d2h_bytes
        stats.link_bytes_per_second = link_bytes_per_second(moved, stats.modeled_transfer_seconds)

    def synchronize(self) -> None:
        self.setup.scheduler.synchronize()

    def prefetch(self) -> None:
        self.driver.prefetching.prefetch()

    @property
    def prefetched(self) -> bool:
        return self.driver.prefetching.prefetched

    def outside_step(self, call: Callable[[], Any], name: str) -> Any:
        """``call`` (the wrapped optimizer's method ``name``) on current states: the offloads finish and a pending
        prefetch is dropped first; with master weights it runs over the fp32 masters, one parameter at a time."""
        self.synchronize()
        self.setup.scheduler.discard_prefetch()
        sync = self.sync
        sync.follow_edits()  # the slots are the states the method is to see
        return self.setup.masters.outside_step(sync.optimizer, self.setup.backend, sync.store.slots, call, method=name)

    def swap_plan(self) -> SwapPlan:
        self._make_missing_states()
        return self.plans.current()

    def host_layout(self) -> HostLayout:
        return self.sync.store.host_layout()

    def initialize_state(self) -> None:
        self.synchronize()
        self._make_missing_states()

    def _make_missing_states(self) -> None:
        sync = self.sync
        sync.follow_edits()
        wanted = [(index, param) for index, param in sync.ordered_params_with_groups() if param.requires_grad]
        self.setup.creation.make_missing(sync, False, lambda: wanted)

    def load_state_dict(self, wrapper: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
        load_state_dict(wrapper, self.sync.optimizer, self.setup.adapter, self.sync, state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        sync = self.sync
        select_backend(self.setup.backend, [*sync.ordered_params(), *param_group["params"]])
        self.synchronize()
        sync.optimizer.add_param_group(param_group)
        sync.follow_edits()

    def params_replaced(self, new_to_old_param: Mapping[torch.Tensor, torch.Tensor] | None) -> None:
        """The parameters changed (``reset_optimizer_parameters``): host mirrors follow replaced parameters, and
        the plan is rebuilt from the current ``param_groups`` and ``state``."""
        sync = self.sync
        if new_to_old_param:
            sync.rekey(new_to_old_param)
        sync.forget_groups_identity()  # re-plan even when the order looks unchanged
        sync.follow_edits()

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        return self.driver.accumulating()

    def take_amp_scaling(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        self.driver.take_amp_scaling(grad_scale, found_inf)

    def before_zero_grad(self, *, set_to_none: bool) -> None:
        """``zero_grad()``: a step begun inside the backward and not stepped is skipped, taken back first."""
        with self.setup.scheduler.working():
            self.driver.before_zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        """The driver lets go (hooks removed, an open step taken back) and the copies in flight finish."""
        self.driver.release()
        self.synchronize()


class NothingSwapped:
    """No backend swaps anything (CPU parameters with ``backend="auto"``): the wrapped optimizer steps alone."""

    claims_amp_scaling = False

    def __init__(self, optimizer: torch.optim.Optimizer, adapter: StateSwapAdapter) -> None:
        self.optimizer = optimizer
        self.adapter = adapter
        self.driver = self

    def is_capturing(self) -> bool:
        return False

    def step(self) -> StepOutcome | None:
        """The wrapped optimizer's own step (this step's hooks ran already: not again for it); no outcome."""
        with step_hooks_silenced(self.optimizer):
            self.optimizer.step()
        return None

    def open_transfer_window(self) -> ModeledTimes | None:
        return None

    def close_transfer_window(self, stats: SwapStats, start: ModeledTimes | None) -> None:
        """No clock."""

    def synchronize(self) -> None:
        """No copies."""

    def prefetch(self) -> None:
        """Nothing to copy."""

    prefetched = False

    def outside_step(self, call: Callable[[], Any], name: str) -> Any:
        return call()

    def swap_plan(self) -> SwapPlan:
        raise ValueError(
            f"{NOTHING_SWAPPED}, so it plans no batches; give its parameters an accelerator or pass "
            "SwapConfig(backend=...)"
        )

    def host_layout(self) -> HostLayout:
        raise ValueError(NOTHING_SWAPPED)

    def initialize_state(self) -> None:
        raise RuntimeError(
            "initialize_state() needs a swap backend; with CPU parameters the wrapped optimizer runs "
            "unswapped and creates its states on its first step"
        )

    def load_state_dict(self, wrapper: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
        load_state_dict(wrapper, self.optimizer, self.adapter, None, state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def params_replaced(self, new_to_old_param: Mapping[torch.Tensor, torch.Tensor] | None) -> None:
        self.adapter.params_changed(ordered_params(self.optimizer.param_groups))

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def take_amp_scaling(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        raise AssertionError("nothing swapped claims GradScaler's scale")

    def before_zero_grad(self, *, set_to_none: bool) -> None:
        """Nothing is open."""

    def close(self) -> None:
        """Nothing to let go."""
