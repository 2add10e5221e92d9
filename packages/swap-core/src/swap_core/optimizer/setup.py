"""Every mode of one swapped optimizer, decided once when it is wrapped.

As DCP's ``_verify_options`` checks its options once into a frozen ``_StateDictInfo``, wrapping checks the
:class:`~swap_core.SwapConfig` against the optimizer, its adapter and its backend into one :class:`SwapSetup`. What
runs below it (the state it follows, the plans, one step's run, the two step drivers) asks the setup's decided
objects, never the config's flags:

- the **update** of a batch: the adapter's, or the adapter's over fp32 masters (``master_weights``);
- how missing states are **created**: before the step by the adapter, or by the optimizer's own update;
- how many **batches** a plan gets: ``swap_times``, or ``"auto"``'s fewest that fit, with its one retry;
- the **plan's shape**: the resident batch first or not (not for an adapter whose updates must run in torch's
  parameter order), the walk's order, the staging buffers and whether the staging is kept between steps;
- the **host memory** of the swapped states (packed or per tensor, exact or caching, which keys and sizes);
- whether each step **records** its timeline, keeps what undoing it needs, prefetches from the backward, and (inside
  the backward) frees the gradients a batch used.

When the batches update (after the backward, or inside it) is the step driver, chosen at the same time
(:func:`~swap_core.optimizer.swapping.start_swapping`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch

from ..adapters.base import StateSwapAdapter
from ..backends.protocol import DeviceBackend
from ..config import SwapConfig
from ..errors import UnsupportedOptimizerError
from ..master_weights.policy import BatchUpdate, Masters
from ..runtime.pipeline import PipelineScheduler
from ..runtime.store import StoreOptions
from ..trace import StepTrace
from .batch_count import BatchCount, batch_count
from .state_creation import StateCreation, state_creation
from .wrapping import swap_keys

__all__ = ["PlanShape", "SwapSetup", "WalkOrder", "decide_setup"]


@dataclasses.dataclass(frozen=True)
class PlanShape:
    """How a plan lays its batches out and stages them."""

    resident_first: bool
    """Parameters whose states all stay on the device update first, in a batch of their own (not when each batch
    updates inside the backward as its gradients become final)."""
    reverse: bool
    """The batches are walked in the order a backward finalizes gradients (the last parameters first)."""
    staging_buffers: int
    max_batch_bytes: int | None
    keep_staging: bool
    """The staging arenas stay allocated between steps."""


@dataclasses.dataclass(frozen=True)
class SwapSetup:
    """The decided modes of one swapped optimizer and the mechanism they run on (see the module)."""

    config: SwapConfig
    """The config as given (for ``repr`` and copies); what runs below the setup reads the fields below."""
    adapter: StateSwapAdapter
    backend: DeviceBackend
    scheduler: PipelineScheduler
    masters: Masters
    """Which parameters keep an fp32 master, and what that changes (``master_weights``)."""
    update: BatchUpdate
    """The update of one batch segment: the adapter itself, or it over the fp32 masters."""
    creation: StateCreation
    batch_count: BatchCount
    plan_shape: PlanShape
    store_options: StoreOptions
    new_trace: Callable[[], StepTrace | None]
    """A timeline for the next step, or ``None`` when steps are not traced."""
    undo_failed_steps: bool
    """Every step keeps what undoing it needs (a first step always does)."""
    prefetch_from_backward: bool
    """The first batch's copy-in is issued from the backward's gradient hooks."""
    free_gradients: bool
    """A batch updated inside the backward drops its gradients once its update is issued."""
    provisional_updates: bool
    """Updates made before ``step()`` are provisional until it commits them (the store keeps spare host copies)."""


class WalkOrder(Protocol):
    """What a step driver says of the plans it walks (:class:`~swap_core.optimizer.step_driver.StepDriver`)."""

    updates_resident_first: bool
    walks_last_batch_first: bool
    updates_before_step: bool


def decide_setup(
    optimizer: torch.optim.Optimizer,
    adapter: StateSwapAdapter,
    config: SwapConfig,
    backend: DeviceBackend,
    masters: Masters,
    driver: WalkOrder,
) -> SwapSetup:
    """The setup of ``optimizer`` swapped by ``adapter`` on ``backend`` as ``config`` asks (checked by wrapping, which
    decided its ``masters`` policy), for plans walked as ``driver`` (the step driver's class) walks them."""
    provisional = driver.updates_before_step and config.provisional_updates
    return SwapSetup(
        config=config,
        adapter=adapter,
        backend=backend,
        scheduler=PipelineScheduler(backend, duplex=config.duplex),
        masters=masters,
        update=masters.update(adapter),
        creation=state_creation(adapter, masters),
        batch_count=batch_count(config, backend),
        plan_shape=_plan_shape(optimizer, adapter, config, driver),
        store_options=StoreOptions(
            swap_keys=swap_keys(optimizer, adapter, config, masters),
            min_numel=config.min_numel,
            # Where host memory is the device's (CPU parameters in master-weights mode) nothing stays resident.
            offload_fraction=0.0 if backend.host_is_device else config.offload_fraction,
            packed=config.packed,
            host_memory=config.host_memory,
            spare=provisional,
        ),
        new_trace=StepTrace if config.trace else _untraced,
        undo_failed_steps=config.undo_failed_steps,
        prefetch_from_backward=config.prefetch == "backward",
        free_gradients=config.free_gradients,
        provisional_updates=provisional,
    )


def _plan_shape(
    optimizer: torch.optim.Optimizer, adapter: StateSwapAdapter, config: SwapConfig, driver: WalkOrder
) -> PlanShape:
    """How the plans of ``optimizer`` are laid out. An adapter whose updates must run in torch's parameter order
    (:attr:`~swap_core.adapters.StateSwapAdapter.needs_parameter_order`) gets no resident batch first, and a walk
    that would go the last parameters first is refused, before anything changes."""
    in_order = adapter.needs_parameter_order
    reverse = driver.walks_last_batch_first or config.prefetch == "backward"
    if in_order is not None and reverse:
        if driver.walks_last_batch_first:
            mode = f"step={config.step!r}"
            walk = "updates each batch as its gradients become final, the last parameters first"
        else:
            mode = "prefetch='backward'"
            walk = "walks the batches in the order a backward finalizes gradients, the last parameters first"
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__name__} cannot be swapped with SwapConfig({mode}): {in_order}; {mode} {walk}. "
            "Nothing was changed. Swap it with SwapConfig(step='after_backward', prefetch='off') (an explicit "
            "opt.prefetch() before step() still starts batch 0's copy-in early), or step it unswapped"
        )
    return PlanShape(
        resident_first=driver.updates_resident_first and in_order is None,
        reverse=reverse,
        staging_buffers=config.staging_buffers,
        max_batch_bytes=config.max_batch_bytes,
        keep_staging=config.keep_staging,
    )


def _untraced() -> StepTrace | None:
    return None
