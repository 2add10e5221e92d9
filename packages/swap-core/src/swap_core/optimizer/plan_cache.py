"""The swap plan of one optimizer, built when :attr:`StateSync.generation` moves and cached until it moves again."""

from __future__ import annotations

import dataclasses

import torch

from ..errors import DeviceMemoryError, SwapStateError
from ..runtime.plan import Partition, SwapPlan, build_plan, staging_bytes
from .auto_batching import AutoBatching
from .state_creation import StateCreation
from .state_sync import StateSync

__all__ = ["PlanCache"]


class PlanCache:
    """Builds the plan from what :class:`StateSync` holds, checking every state first, and keeps it while nothing
    it is bound to changes."""

    def __init__(self, sync: StateSync, creation: StateCreation, auto: AutoBatching | None) -> None:
        self.sync = sync
        self.creation = creation
        self.auto = auto
        """``swap_times="auto"``'s choices, or ``None`` with a fixed ``swap_times``."""
        self.resident_bytes = 0
        """Device bytes of the states that stay on the device, as of the last plan built."""
        self._plan: SwapPlan | None = None
        self._generation = -1
        sync.on_change(self.drop)

    @property
    def last(self) -> SwapPlan | None:
        """The plan built last, current or not (``None`` before any, or after :meth:`drop`)."""
        return self._plan

    def drop(self) -> None:
        """Forget the plan (its staging goes with it): the next :meth:`current` builds one afresh."""
        self._plan = None

    def is_current(self) -> bool:
        plan = self._plan
        if plan is None or self._generation != self.sync.generation:
            return False
        assert plan.version == self.sync.store.version, "the store changed without StateSync.changed()"
        return True

    def states_complete(self) -> bool:
        """Whether every parameter already has its state (then no per-parameter scan is needed)."""
        return self.is_current() and self._plan is not None and self._plan.all_states_exist

    def current(self) -> SwapPlan:
        """The plan for the state as it is now; a state the update cannot use fails here, before any batch runs."""
        if self.is_current():
            assert self._plan is not None
            return self._plan
        sync = self.sync
        generation, store, config, adapter = sync.generation, sync.store, sync.config, sync.adapter
        params = sync.ordered_params_with_groups()
        sync.check_states(params, SwapStateError)
        costs = adapter.partition_costs([param for _, param in params])
        rank_independent = costs is not None
        if costs is None:
            costs = self.creation.partition_costs(store, [param for _, param in params])
        swap_times = config.swap_times
        partition = Partition(
            num_batches=1 if swap_times == "auto" else swap_times,
            max_batch_bytes=config.max_batch_bytes,
            costs=costs,
            state=sync.state,
            # Inside the backward every parameter updates with its batch, once its gradient is final.
            resident_first=not rank_independent and config.step != "in_backward",
            reverse=config.walks_in_backward_order,
            staging_buffers=config.staging_buffers,
        )
        if self.auto is not None:
            count = self._auto_count(self.auto, params, partition, rank_independent=rank_independent)
            partition = dataclasses.replace(partition, num_batches=count)
        self._plan = build_plan(store, sync.backend, params, partition, walk_every_batch=rank_independent)
        if self.auto is not None:
            self.auto.log(self._plan)
        self._generation = generation
        self.resident_bytes = store.resident_bytes(param for _, param in params)
        return self._plan

    def _auto_count(
        self,
        auto: AutoBatching,
        params: list[tuple[int, torch.Tensor]],
        partition: Partition,
        *,
        rank_independent: bool,
    ) -> int:
        """``swap_times="auto"``: the batches of the plan about to be built (every rank's count where every rank
        walks the same batches)."""
        store = self.sync.store
        fits_nowhere: DeviceMemoryError | None = None
        try:
            count = auto.choose(
                lambda count: staging_bytes(store, params, dataclasses.replace(partition, num_batches=count)),
                len(params),
            )
        except DeviceMemoryError as error:
            if not rank_independent:
                raise
            fits_nowhere, count = error, len(params) + 1  # the others must learn it, not wait for this rank
        if rank_independent:  # every rank walks the same batches: the count that fits every rank
            count = self.sync.adapter.agree_on_batches(count)
            if count > len(params):
                raise fits_nowhere or DeviceMemoryError(
                    "swap_times='auto': another rank's device cannot stage even one parameter per batch "
                    "(its error names the bytes); every rank stops before anything changes"
                )
        # A rank cannot retry alone with more batches where every rank must walk the same ones.
        auto.chose(count, len(params), may_retry=not rank_independent)
        return count
