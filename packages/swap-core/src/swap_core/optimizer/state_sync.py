"""The wrapped optimizer's ``state`` and ``param_groups``, followed into the swap runtime.

:class:`StateSync` owns what the runtime knows of the wrapped optimizer: the tracked ``state`` mapping,
the :class:`~swap_core.runtime.store.StateStore` of host mirrors, the parameter order, and one
:attr:`~StateSync.generation` counter that moves whenever any of them changes (the plan is keyed on
it alone). It follows a torch user's edits (``del opt.state[p]``, a replaced tensor, edited param
groups, a load through the wrapped optimizer), adopts states made elsewhere, creates missing ones and
commits a loaded checkpoint, each all or nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..adapters.base import StateInit, StateSwapAdapter
from ..backend_selection import select_backend
from ..backends.protocol import DeviceBackend
from ..dtensor import local_tensor
from ..master_weights.policy import Masters
from ..runtime.nested_entries import flat_items, value_at
from ..runtime.pipeline import PipelineScheduler
from ..runtime.slots import SwapSlot
from ..runtime.state_keys import MASTER_KEY, is_fresh
from ..runtime.store import StateSource, StateStore, StoreOptions
from ..runtime.tracked_state import TrackedState
from .wrapping import (
    check_distinct_params,
    check_states,
    ordered_params,
    ordered_params_with_groups,
)

__all__ = ["NO_ENTRY", "StateSync"]

GroupsIdentity = tuple[list[int], list[int]]
"""Identity of ``param_groups``: the ids of the parameters in order, and the size of each group."""

_MirrorCheck = tuple[int, list[dict[str, Any]], list[str], list[torch.Tensor | None]]
"""``(generation, state entry, key and host mirror of each swapped state)``; dropped with its store."""

NO_ENTRY: dict[str, Any] = {}
"""What a parameter without an entry in ``state`` holds (never written to)."""


class StateSync:
    """The swap runtime's view of one wrapped optimizer's ``state`` and ``param_groups``, kept in line with them."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        adapter: StateSwapAdapter,
        scheduler: PipelineScheduler,
        store_options: StoreOptions,
        masters: Masters,
    ) -> None:
        """Follows ``optimizer`` for ``adapter``; its states move through ``scheduler``'s backend, in host memory laid
        out as ``store_options`` says, with fp32 masters as ``masters`` says."""
        self.optimizer = optimizer
        self._adapter = adapter
        self._scheduler = scheduler
        self._backend: DeviceBackend = scheduler.backend
        self._store_options = store_options
        self.masters = masters
        self.generation = 0
        """Moves whenever the store, its slots, the parameters or the entries bound to a plan change."""
        self._store: StateStore | None = None
        self._tracked = TrackedState()
        self._seen_state_version = -1
        self._groups_identity: GroupsIdentity = ([], [])
        self._mirror_check: _MirrorCheck | None = None
        self._host_cache_emptied_at: tuple[int, int] | None = None
        self._on_change: list[Callable[[], None]] = []

    def start(self) -> None:
        """Take over the wrapped optimizer as it is: its parameters declared, its states moved to host memory."""
        self._adopt_params()
        self.adopt_state()  # existing states move to host memory (may find the host too small)
        self._groups_identity = _groups_identity(self.param_groups, self.ordered_params())

    def await_offloads(self) -> None:
        """Block until every copy into or out of the host mirrors finished (the host may read and write them)."""
        self._scheduler.synchronize()

    def changed(self) -> None:
        """Something the plan is bound to changed: the next plan is built afresh, and what holds the old one drops
        it now (it holds host buffers a replaced store no longer owns, and staging)."""
        self.generation += 1
        for drop in self._on_change:
            drop()

    def on_change(self, drop: Callable[[], None]) -> None:
        """Call ``drop`` at every :meth:`changed`."""
        self._on_change.append(drop)

    # -- the wrapped optimizer's objects ----------------------------------------------
    @property
    def store(self) -> StateStore:
        assert self._store is not None, "StateSync.start() makes the store"
        return self._store

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def tracked(self) -> TrackedState:
        return self._tracked

    def ordered_params(self) -> list[torch.Tensor]:
        return ordered_params(self.param_groups)

    def ordered_params_with_groups(self) -> list[tuple[int, torch.Tensor]]:
        return ordered_params_with_groups(self.param_groups)

    # -- following what the user did to state and param_groups -----------------------
    def follow_edits(self, ordered: list[torch.Tensor] | None = None) -> None:
        """Bring the swap runtime in line with what was done to ``param_groups`` and ``state`` since the last look
        (``ordered``: :meth:`ordered_params`, when the caller has it already).

        Cheap when nothing changed, as in almost every step: two identity checks, one integer, and one
        C-level pass over the parameter ids and over the swapped entries of ``state``.
        """
        if ordered is None:
            ordered = self.ordered_params()
        identity = _groups_identity(self.param_groups, ordered)
        groups_changed = identity != self._groups_identity
        if groups_changed:
            check_distinct_params(self.param_groups)
            select_backend(self._backend, ordered)
            self._params_changed()
            self._groups_identity = identity
        if self.optimizer.state is not self._tracked:
            self.adopt_state()  # the wrapped optimizer's load_state_dict, or `state` assigned
        elif self._tracked.version != self._seen_state_version or not self._mirrors_in_place():
            self._resync_states(ordered)
        elif groups_changed:
            self.store.reorder(ordered)

    def has_edits(self) -> bool:
        """Whether :meth:`follow_edits` would find anything to follow (it changes nothing itself): the parameters or
        groups changed, the state mapping was replaced, an entry was reset or a host mirror replaced."""
        if _groups_identity(self.param_groups, self.ordered_params()) != self._groups_identity:
            return True
        if self.optimizer.state is not self._tracked or self._tracked.version != self._seen_state_version:
            return True
        return not self._mirrors_in_place()

    def mirrors_moved(self) -> None:
        """The store made its spare copies the host mirrors (:meth:`StateStore.flip`): ``state`` shows them, and the
        next look compares entries with them."""
        self._mirror_check = None

    def forget_groups_identity(self) -> None:
        """The next :meth:`follow_edits` re-plans even when the parameter order looks unchanged."""
        self._groups_identity = ([], [])

    def rekey(self, new_to_old_param: Mapping[torch.Tensor, torch.Tensor]) -> None:
        """Host mirrors follow their states to the parameter objects that replace theirs."""
        self.store.rekey(new_to_old_param)
        self.changed()

    def _params_changed(self) -> None:
        ordered = self.ordered_params()
        self.masters.check_supported(self.optimizer, self._adapter, ordered)
        self._adapter.params_changed(ordered)  # may refuse: nothing has changed yet
        self.changed()
        self._adopt_params()

    def _adopt_params(self) -> None:
        for param in self.ordered_params():
            self._backend.adopt(local_tensor(param))

    def _mirrors_in_place(self) -> bool:
        """Whether every swapped state's entry in ``state`` still is its host mirror."""
        store = self.store
        check = self._mirror_check
        if check is None or check[0] != self.generation:
            slots = [slot for param_slots in store.slots.values() for slot in param_slots.values()]
            entries = [self.state.get(slot.param, NO_ENTRY) for slot in slots]
            check = (self.generation, entries, [slot.key for slot in slots], [slot.host_value for slot in slots])
            self._mirror_check = check
        _, entries, keys, values = check
        found = value_at if self._adapter.swaps_nested_states else dict.get  # a path into a nested dict, or a key
        return all(map(operator.is_, map(found, entries, keys), values))

    def adopt_state(self) -> None:
        """Make the wrapped optimizer's current ``state`` the swapped one: tracked, swapped tensors in host memory.

        All or nothing: if the host cannot hold them, the optimizer is left exactly as it was.
        """
        state = self.optimizer.state
        previous = (self._tracked, self._seen_state_version, self._store, self._mirror_check)
        tracked = state if isinstance(state, TrackedState) else TrackedState(state)
        self.optimizer.state = tracked
        self.track(tracked)
        try:
            self.replace_store(self.new_store())
            self.offload_existing_states(self.ordered_params())
        except BaseException:
            self.optimizer.state = state
            self._tracked, self._seen_state_version, self._store, self._mirror_check = previous
            self.changed()
            raise

    def track(self, state: TrackedState) -> None:
        """``state`` is the optimizer's from now on: a read of it from outside the optimizer's work first waits for
        the copies in flight (a user's edit in place between steps must not be overwritten by a copy landing)."""
        state.before_access = self._scheduler.settle_for_host
        self._tracked = state
        self._seen_state_version = state.version

    def replace_store(self, store: StateStore) -> None:
        """A new store: nothing may keep the old one's host memory (or its states' device memory) alive.

        The old host buffers are freed once nothing refers to them: the copies into them are waited for first
        (freeing pinned memory a copy still writes would let the copy write into memory given to others).
        """
        if self._store is not None:
            self._scheduler.synchronize()
        self._store = store
        self._mirror_check = None
        self.changed()

    def _resync_states(self, ordered: list[torch.Tensor]) -> None:
        """Entries of ``state`` reset or replaced by hand: their host mirrors give way to what is there now.

        A parameter whose entry is gone or empty starts afresh at its next step, as torch's does; a
        tensor put in place of a host mirror is taken over (copied into host memory).
        """
        store = self.store
        stale = [
            param
            for param, slots in store.slots.items()
            if any(value_at(self.state.get(param, NO_ENTRY), key) is not slot.host_value for key, slot in slots.items())
        ]
        with store.all_or_nothing():
            store.remove(stale)
            if not self.offload_existing_states(stale, order=ordered):
                store.reorder(ordered)  # nothing was added (which re-packs): re-pack without the removed slots
        self._seen_state_version = self._tracked.version
        self.changed()  # state dicts are bound to the batches

    # -- checks ---------------------------------------------------------------------
    def check_states(
        self,
        params: Sequence[tuple[int, torch.Tensor]],
        error: Callable[[str], Exception],
        *,
        masters_to_make: bool = False,
    ) -> None:
        """:func:`check_states` of the wrapped optimizer's states."""
        check_states(
            self.optimizer,
            self._adapter,
            params,
            error,
            masters=self.masters,
            masters_to_make=masters_to_make,
        )

    def check_room_for_states_the_update_creates(self, params_with_grad: Iterable[tuple[int, torch.Tensor]]) -> None:
        """States the update is about to create (an adapter whose update makes them): refused before any batch
        updates anything if host memory cannot take them (else the step would fail part-way, after earlier batches
        were updated)."""
        fresh = [
            (param, key, template)
            for group_index, param in params_with_grad
            if is_fresh(self.state.get(param) or {})
            for key, template in self._adapter.expected_states(
                self.masters.as_updated(param), self.param_groups[group_index]
            ).items()
        ]
        if fresh:
            self.store.check_room_for(fresh, self.ordered_params())

    # -- states made, moved and packed --------------------------------------------------
    def create_states(self, fresh: Sequence[tuple[torch.Tensor, Mapping[str, torch.Tensor | StateInit]]]) -> None:
        """Fresh states (``initial``, plus the master with master weights) of parameters that have none, swapped ones
        born on the host; all or nothing (each parameter has no state again if the host lacks the memory)."""
        if not fresh:
            return
        self.changed()
        store = self.store
        new: list[tuple[SwapSlot, StateSource]] = []
        try:
            with store.all_or_nothing():
                for param, initial in fresh:
                    state = self.state[param]
                    values = {**initial, **self.masters.fresh_master(param)}
                    for key, value in values.items():
                        state[key] = value
                        if not isinstance(value, StateInit):
                            continue
                        # The master starts as the parameter, exactly (fp32 holds every bf16/fp16 value).
                        source: StateSource = param.detach() if key == MASTER_KEY else float(value.fill)
                        if store.should_swap(key, value):
                            new.append((_slot_for(param, key, value), source))
                        else:
                            state[key] = store.resident_value(value, param)
                            if isinstance(source, torch.Tensor):
                                state[key].copy_(source)
                store.add(new, self.ordered_params())
        except BaseException:
            for param, _ in fresh:  # each had no state: it has none again (e.g. the host lacked the memory)
                self.state[param].clear()
            raise

    def offload_existing_states(
        self, params: Iterable[torch.Tensor], order: Sequence[torch.Tensor] | None = None, *, unpacked: bool = False
    ) -> int:
        """Existing state tensors of ``params`` move to host memory now; returns how many.

        They were created or loaded before wrapping, put in place of a host mirror by hand, or created
        by the update of a step (``unpacked``: packed later, see :meth:`StateStore.add`).
        """
        store = self.store
        new: list[tuple[SwapSlot, StateSource]] = []
        nested = self._adapter.swaps_nested_states
        for param in params:
            swapped = store.slots.get(param, NO_ENTRY)  # e.g. the master, made before the update
            for key, value in flat_items(self.state.get(param, NO_ENTRY), nested=nested):
                if key in swapped:
                    continue
                if isinstance(value, torch.Tensor) and store.should_swap(key, value):
                    new.append((SwapSlot.sharded_like(param, key, value.dtype, like=value), value))
        store.add(new, self.ordered_params() if order is None else order, unpacked=unpacked)
        if new:
            self.changed()
        return len(new)

    def pack_fresh_states(self, ordered: list[torch.Tensor]) -> None:
        """Pack the host buffers of states created during a step (given buffers of their own meanwhile)."""
        if self.store.has_unpacked:
            self._scheduler.synchronize()  # the re-layout reads every host mirror: offloads must be done
            self.store.pack(ordered)
            self.changed()

    def new_store(self) -> StateStore:
        """An empty store for this optimizer's states, laid out as the config says."""
        return StateStore(
            self._backend,
            self.state,
            self._store_options,
            copy_stream=self._scheduler.d2h,
            await_offloads=self._scheduler.synchronize,
        )

    def commit_load(self, store: StateStore, state: TrackedState, ordered: list[torch.Tensor]) -> None:
        """A checkpoint staged in ``store`` (the live one, for a load in place) becomes the live state."""
        self.track(state)
        self._groups_identity = _groups_identity(self.param_groups, ordered)
        store.attach(self.state)
        self._mirror_check = None
        self.changed()

    def empty_host_cache_after_relayout(self) -> None:
        """With ``host_memory="caching"``, host buffers a re-layout (or a load, or a reset) replaced stay pinned in
        torch's caching host allocator: give them back once per layout, after the step that dropped the last
        references to them (its plan and any prefetch), so the process pins its layout once, not twice."""
        layout = self.store.layout_id
        if self._store_options.host_memory == "caching" and layout != self._host_cache_emptied_at:
            self._mirror_check = None  # it may hold the replaced mirrors (it is rebuilt for a new layout anyway)
            self._backend.empty_host_cache()
            self._host_cache_emptied_at = layout


def _groups_identity(groups: Sequence[Mapping[str, Any]], ordered: Sequence[torch.Tensor]) -> GroupsIdentity:
    return list(map(id, ordered)), [len(group["params"]) for group in groups]


def _slot_for(param: torch.Tensor, key: str, init: StateInit) -> SwapSlot:
    """A slot for a fresh state: a shard like ``param``'s, or a whole tensor this rank holds alone."""
    if init.shard_like_param:
        return SwapSlot.sharded_like(param, key, init.dtype)
    return SwapSlot.whole(param, key, init.shape, init.dtype)
