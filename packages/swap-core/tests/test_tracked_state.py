"""``TrackedState``: torch's ``defaultdict(dict)`` for ``optimizer.state``, counting the edits a user makes."""

from __future__ import annotations

import copy
import pickle
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import torch

from swap_core.runtime.tracked_state import TrackedState

PARAMS = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]


def _state() -> TrackedState:
    return TrackedState({PARAMS[0]: {"step": torch.tensor(1.0)}, PARAMS[1]: {}})


EDITS: dict[str, Callable[[TrackedState], Any]] = {
    "setitem": lambda state: state.__setitem__(PARAMS[0], {}),
    "delitem": lambda state: state.__delitem__(PARAMS[0]),
    "clear": lambda state: state.clear(),
    "pop": lambda state: state.pop(PARAMS[0]),
    "popitem": lambda state: state.popitem(),
    "update": lambda state: state.update({PARAMS[2]: {}}),
    "ior": lambda state: state.__ior__({PARAMS[2]: {}}),
    "setdefault_new": lambda state: state.setdefault(PARAMS[2], {}),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_every_edit_of_the_mapping_is_counted(edit: str) -> None:
    state = _state()
    before = state.version
    EDITS[edit](state)
    assert state.version > before


def test_reading_a_missing_entry_creates_it_without_counting_as_an_edit() -> None:
    state = _state()
    entry = state[PARAMS[2]]  # what torch's _init_group does for a parameter without state
    assert entry == {} and state[PARAMS[2]] is entry
    assert state.setdefault(PARAMS[0]) is state[PARAMS[0]]
    assert state.get(PARAMS[2]) is entry
    assert state.version == 0


def test_it_is_a_defaultdict_of_dicts_that_survives_deepcopy_and_pickle() -> None:
    state = _state()
    assert isinstance(state, defaultdict) and state.default_factory is dict
    for copied in (copy.deepcopy(state), pickle.loads(pickle.dumps(state))):
        assert isinstance(copied, TrackedState) and copied.default_factory is dict
        assert [float(entry["step"]) for entry in copied.values() if entry] == [1.0]
        assert len(copied) == 2


def test_lent_entries_are_there_for_the_block_only_and_are_not_a_change() -> None:
    kept, lent, replaced = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    state = TrackedState({kept: {"a": 1}, replaced: {"b": 2}})
    version = state.version
    with state.lent([(lent, {"c": 3}), (replaced, {"d": 4})]):
        assert state[lent] == {"c": 3} and state[replaced] == {"d": 4}
        assert state.version == version
    assert lent not in state and state[replaced] == {"b": 2} and state[kept] == {"a": 1}
    assert state.version == version
    with pytest.raises(RuntimeError, match="inside"), state.lent([(lent, {})]):
        raise RuntimeError("inside")
    assert lent not in state and state.version == version
