"""The swap plan of one optimizer, built when :attr:`StateSync.generation` moves and cached until it moves again."""

from __future__ import annotations

import dataclasses

import torch

from ..errors import SwapStateError
from ..runtime.plan import Partition, SwapPlan, build_plan, staging_bytes
from .setup import SwapSetup
from .state_sync import StateSync

__all__ = ["PlanCache"]


class PlanCache:
    """Builds the plan from what :class:`StateSync` holds, after following the user's edits and checking every state,
    and keeps it while nothing it is bound to changes."""

    def __init__(self, setup: SwapSetup, sync: StateSync) -> None:
        self.setup = setup
        self.sync = sync
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
        """The plan for the state as it is now, the user's edits followed first; a state the update cannot use fails
        here, before any batch runs."""
        sync = self.sync
        sync.follow_edits()
        if self.is_current():
            assert self._plan is not None
            return self._plan
        generation, store, setup = sync.generation, sync.store, self.setup
        params = sync.ordered_params_with_groups()
        sync.check_states(params, SwapStateError)
        costs = setup.adapter.partition_costs([param for _, param in params])
        rank_independent = costs is not None
        if costs is None:
            costs = setup.creation.partition_costs(sync, [param for _, param in params])
        shape = setup.plan_shape
        partition = Partition(
            num_batches=1,
            max_batch_bytes=shape.max_batch_bytes,
            costs=costs,
            state=sync.state,
            # Adapter costs are rank-independent: every rank walks the same batches, and residency is per rank.
            resident_first=shape.resident_first and not rank_independent,
            reverse=shape.reverse,
            staging_buffers=shape.staging_buffers,
        )
        batches = setup.batch_count.batches(
            lambda count: staging_bytes(store, params, dataclasses.replace(partition, num_batches=count)),
            len(params),
            agree=setup.adapter.agree_on_batches if rank_independent else None,
        )
        partition = dataclasses.replace(partition, num_batches=batches)
        self._plan = build_plan(
            store, setup.backend, params, partition, walk_every_batch=rank_independent, keep_staging=shape.keep_staging
        )
        setup.batch_count.log(self._plan)
        self._generation = generation
        self.resident_bytes = store.resident_bytes(param for _, param in params)
        return self._plan

    def retry_after(self, error: BaseException, *, updates_begun: int, retried: bool) -> bool:
        """A step failed with ``error``: whether it may run again, over a plan made afresh (with ``swap_times="auto"``,
        twice the batches after an out-of-memory before any update began); a second out-of-memory raises
        :class:`~swap_core.errors.DeviceMemoryError`."""
        if not isinstance(error, torch.OutOfMemoryError):
            return False
        if not self.setup.batch_count.retry_after(error, updates_begun=updates_begun, retried=retried, last=self._plan):
            return False
        self.drop()
        return True
