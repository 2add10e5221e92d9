"""``load_state_dict`` of a swapped optimizer, and states taken over without fp32 masters.

The checkpoint is checked and staged completely (:func:`~swap_core.state_dict_loading.load_swapped_state`) before
:meth:`StateSync.commit_load` makes it the live state; a class with a ``load_state_dict`` of its own loads with it,
and what it loaded is then taken over into host memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..adapters.base import StateSwapAdapter
from ..dtensor import local_tensor
from ..runtime.state_keys import MASTER_KEY, MASTER_KEYS
from ..state_dict_loading import load_swapped_state
from ..torch_compat import (
    LOAD_STATE_DICT_HOOKS,
    STATE_DICT_HOOKS,
    hook_registries_set_aside,
    load_state_dict_hook_registries,
)
from ..user_warnings import warn_user
from .state_sync import StateSync
from .wrapping import overrides

__all__ = ["PLAIN_CHECKPOINT", "STATES_BEFORE_WRAPPING", "load_state_dict", "make_masters_of_existing_states"]

PLAIN_CHECKPOINT = (
    f"The checkpoint has no {MASTER_KEY!r} for {{count}} bfloat16/float16 parameter(s) (saved without master "
    "weights): their fp32 masters start as the parameters' current values, and their loaded states are kept in fp32"
)
_LOW_PRECISION_MASTERS = (
    f"The checkpoint holds {{count}} {MASTER_KEY!r} in a lower precision than float32 (cast down before it was "
    "saved, e.g. with the model's own dtype): they load as float32 from their rounded values, so the precision "
    "master weights keep was lost before this load"
)
STATES_BEFORE_WRAPPING = (
    "{count} bfloat16/float16 parameter(s) had optimizer states before wrapping (made by an earlier step or by "
    "{name}'s constructor) and no fp32 master: their masters start as the parameters, and their states are kept in "
    "fp32 from now on (cast from the parameters' dtype, so a state value that dtype cannot hold exactly differs "
    "from an fp32-master run's)"
)


def load_state_dict(
    wrapper: torch.optim.Optimizer,
    optimizer: torch.optim.Optimizer,
    adapter: StateSwapAdapter,
    sync: StateSync | None,
    state_dict: Mapping[str, Any],
) -> None:
    """:meth:`SwapOptimizer.load_state_dict` of ``wrapper`` over ``optimizer``: the load hooks run once, given
    ``wrapper``, on every path; ``sync`` is ``None`` when nothing is swapped (the checkpoint then loads as it is:
    the adapter's ``import_state_dict`` is for a live layout of its own, which an unswapped optimizer never has)."""
    if sync is not None:
        sync.await_offloads()
    # The wrapped optimizer's own load_state_dict (CPU parameters, or a class with its own) would run the same
    # (shared) hooks given itself: set aside while it runs.
    state_dict = state_dict.copy() if isinstance(state_dict, dict) else dict(state_dict)
    pre_hooks, post_hooks = load_state_dict_hook_registries(wrapper)
    for pre_hook in pre_hooks.values():
        result = pre_hook(wrapper, state_dict)
        if result is not None:
            state_dict = result
    with hook_registries_set_aside(optimizer, LOAD_STATE_DICT_HOOKS):
        if sync is None:  # nothing swapped: the wrapped optimizer's step keeps its state in its own layout
            optimizer.load_state_dict(dict(state_dict))
        elif overrides(optimizer, "load_state_dict"):
            # Its own format and casting rules (bitsandbytes keeps uint8 codes uint8): its own method loads, and
            # the loaded state is then taken over into host memory, as after a load through the wrapped optimizer.
            with sync.masters.params_presented(optimizer):
                optimizer.load_state_dict(dict(adapter.import_state_dict(state_dict)))
            sync.follow_edits()
            make_masters_of_existing_states(sync, adapter, PLAIN_CHECKPOINT)
        else:
            _load_swapped(sync, adapter, state_dict)
    for post_hook in post_hooks.values():
        post_hook(wrapper)


def make_masters_of_existing_states(sync: StateSync, adapter: StateSwapAdapter, warning: str) -> None:
    """States without masters (made before wrapping, or loaded by the optimizer's own method): masters from params.

    An optimizer stepped before wrapping, or one whose constructor makes states (Adagrad's ``sum``),
    holds states in the parameters' dtype. They are taken as a checkpoint saved without master
    weights is loaded: the master starts as the parameter, the states are kept in fp32 (exact
    where the parameter's dtype held their values exactly, as zeros). ``warning`` (formatted with
    ``count``) says so once.
    """
    state, masters = sync.state, sync.masters
    lacking = [
        param
        for param in sync.ordered_params()
        if masters.keeps(param) and state.get(param) and MASTER_KEYS.isdisjoint(state[param])
    ]
    if not lacking:
        return
    with hook_registries_set_aside(sync.optimizer, STATE_DICT_HOOKS):
        plain = torch.optim.Optimizer.state_dict(sync.optimizer)
    _load_swapped(sync, adapter, plain, warn_of_made_masters=False)
    warn_user(warning.format(count=len(lacking), name=type(sync.optimizer).__name__), UserWarning)


def _load_swapped(
    sync: StateSync, adapter: StateSwapAdapter, state_dict: Mapping[str, Any], *, warn_of_made_masters: bool = True
) -> None:
    """Stage ``state_dict`` in host memory, checked completely, then commit it (the swapped path)."""
    ordered = sync.ordered_params()
    sync.follow_edits(ordered)
    state_dict = adapter.import_state_dict(state_dict)
    store = sync.new_store()
    staged = load_swapped_state(sync.param_groups, adapter, store, state_dict, masters=sync.masters)
    groups, state, loaded = staged.param_groups, staged.state, staged.swapped
    if staged.masters_from_params and warn_of_made_masters:
        warn_user(PLAIN_CHECKPOINT.format(count=staged.masters_from_params), UserWarning)
    if staged.low_precision_masters:
        warn_user(_LOW_PRECISION_MASTERS.format(count=staged.low_precision_masters), UserWarning)
    if sync.store.load_in_place(loaded, state):
        # The loaded layout is the live one (a resume): the mirrors took the values, nothing was allocated.
        store = sync.store
    else:
        store.attach(state)
        store.add(loaded, ordered)
        sync.replace_store(store)
    # Finish as torch's load_state_dict does: the wrapped optimizer's __setstate__ fills option
    # defaults missing from older checkpoints (and AdamW forces decoupled weight decay).
    sync.optimizer.__setstate__({"state": state, "param_groups": groups})
    sync.commit_load(store, state, ordered)
    # A master loaded as its remainder is over its cast: the parameter becomes it (the master's top bits).
    with torch.no_grad():
        for param, cast in staged.params_to_set:
            local_tensor(param).copy_(cast)
