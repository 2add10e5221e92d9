"""When a step's missing states are made, chosen once at wrapping from the adapter's ``lazy_states``.

:class:`StatesBeforeTheStep`: the adapter's ``initial_state`` makes every missing state before the pipeline runs
(swapped ones born in host memory), so every batch finds its states. :class:`StatesMadeByTheUpdate`: the adapter
runs the optimizer's own step, which makes them on the device during its batch; they go to host memory after
that batch, and are packed after the step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..adapters.base import StateInit, StateSwapAdapter
from ..dtensor import local_tensor
from ..master_weights.policy import Masters
from ..runtime.plan import SwapPlan
from ..runtime.state_keys import is_fresh
from .state_sync import StateSync

__all__ = ["StateCreation", "StatesBeforeTheStep", "StatesMadeByTheUpdate", "state_creation"]

ParamsWithGrad = Callable[[], list[tuple[int, torch.Tensor]]]
"""``(group index, parameter)`` of this step's parameters with a gradient (computed on demand)."""


class StatesBeforeTheStep:
    """Missing states made from the adapter's ``initial_state`` before any batch runs."""

    update_adds_keys = False
    """The update writes the states made for it, adding no key."""

    def __init__(self, adapter: StateSwapAdapter, masters: Masters) -> None:
        self.adapter = adapter
        self.masters = masters

    def before_journal(self, sync: StateSync, ordered: list[torch.Tensor]) -> None:
        """Nothing is left unpacked by an earlier step."""

    def make_missing(self, sync: StateSync, complete: bool, params_with_grad: ParamsWithGrad) -> list[torch.Tensor]:
        """Every missing state of the parameters with a gradient (masters included), unless ``complete``; the
        parameters it made states for."""
        if complete:
            return []
        asked = [
            (param, self.adapter.initial_state(self.masters.as_updated(param), sync.param_groups[group_index]))
            for group_index, param in params_with_grad()
            if not sync.state[param]
        ]
        # A parameter the adapter keeps no state for (distributed Muon's matrices another rank owns) has nothing
        # to create: left out, it does not make the plan be built again at every step.
        fresh = [(param, initial) for param, initial in asked if initial or self.masters.keeps(param)]
        sync.create_states(fresh)
        return [param for param, _ in fresh]

    def partition_costs(self, sync: StateSync, params: list[torch.Tensor]) -> list[int] | None:
        """Every state exists when the plan is made: the swapped bytes balance the batches."""
        return None

    def before_batches(
        self, sync: StateSync, plan: SwapPlan, params_with_grad: ParamsWithGrad, *, reverse: bool
    ) -> set[int] | None:
        """The states exist, in host memory already: nothing for :meth:`after_run` to put in order."""
        return None

    def fresh(self, params: Sequence[torch.Tensor], states: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        """No batch makes a state."""
        return []

    def missing_state(self, sync: StateSync, param: torch.Tensor) -> dict[str, Any]:
        raise AssertionError("states of parameters with a gradient exist before the pipeline")

    def after_run(self, sync: StateSync, ordered: list[torch.Tensor], entries_before: set[int] | None) -> None:
        """Nothing to pack or to put in order."""


class StatesMadeByTheUpdate:
    """States the optimizer's own step makes on the device, batch by batch: each batch's go to host memory before
    the next batch makes its own, and they are packed after the step."""

    update_adds_keys = True
    """The optimizer's own step may add a key to a state it made at an earlier step (an SWA-style average begun
    later): such keys go to host memory like a fresh state's."""

    def __init__(self, masters: Masters) -> None:
        self.masters = masters

    def before_journal(self, sync: StateSync, ordered: list[torch.Tensor]) -> None:
        """Pack those a failed step left unpacked."""
        sync.pack_fresh_states(ordered)

    def make_missing(self, sync: StateSync, complete: bool, params_with_grad: ParamsWithGrad) -> list[torch.Tensor]:
        """With master weights, the masters, which the update runs on, come first; the states are the update's. The
        parameters it made masters for."""
        if complete:
            return []
        empty: dict[str, torch.Tensor | StateInit] = {}
        fresh = [
            (param, empty) for _, param in params_with_grad() if self.masters.keeps(param) and not sync.state[param]
        ]
        sync.create_states(fresh)
        return [param for param, _ in fresh]

    def partition_costs(self, sync: StateSync, params: list[torch.Tensor]) -> list[int] | None:
        """Batching costs while some states are still to be made by the update, or ``None`` once none is.

        A state not made yet has no size: the parameter's own bytes stand in for it, so that the first step
        spreads the fresh states over ``swap_times`` batches as later steps spread them.
        """
        state, store = sync.state, sync.store
        if all(state.get(param) for param in params):
            return None
        costs = []
        for param in params:
            slots = store.slots.get(param)
            if slots:
                costs.append(sum(slot.nbytes for slot in slots.values()))
            elif state.get(param):
                costs.append(0)  # a state without swapped tensors
            else:
                local = local_tensor(param)
                costs.append(local.numel() * local.element_size())
        return costs

    def before_batches(
        self, sync: StateSync, plan: SwapPlan, params_with_grad: ParamsWithGrad, *, reverse: bool
    ) -> set[int] | None:
        """Refuse, before any batch updates anything, states the host could not take; the ids of the entries of
        ``state`` when batches walked in ``reverse`` (``prefetch="backward"``) may create states out of parameter
        order, for :meth:`after_run` to put them back in torch's order."""
        if plan.all_states_exist:
            return None
        sync.check_room_for_states_the_update_creates(params_with_grad())
        return set(map(id, sync.state)) if reverse else None

    def fresh(self, params: Sequence[torch.Tensor], states: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        """The parameters of a batch segment whose states its update is about to make."""
        return [param for param, state in zip(params, states, strict=True) if is_fresh(state)]

    def missing_state(self, sync: StateSync, param: torch.Tensor) -> dict[str, Any]:
        """The entry of ``param``, or an empty dict: the optimizer's own step creates the entry if it keeps a state
        (plain SGD keeps none, and its ``state`` stays empty as torch's does)."""
        entry: dict[str, Any] = sync.state.get(param, {})
        return entry

    def after_run(self, sync: StateSync, ordered: list[torch.Tensor], entries_before: set[int] | None) -> None:
        """Put the entries the batches made in parameter order (where they were walked in reverse), and pack the
        host buffers their swapped states were given."""
        if entries_before is not None:
            sync.tracked.move_to_end(
                param for param in ordered if id(param) not in entries_before and param in sync.state
            )
        sync.pack_fresh_states(ordered)


StateCreation = StatesBeforeTheStep | StatesMadeByTheUpdate


def state_creation(adapter: StateSwapAdapter, masters: Masters) -> StateCreation:
    """The way ``adapter``'s optimizer gets its states, chosen once (each method is given the state it works on)."""
    return StatesMadeByTheUpdate(masters) if adapter.lazy_states else StatesBeforeTheStep(adapter, masters)
