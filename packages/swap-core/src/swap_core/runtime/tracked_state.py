"""``optimizer.state`` as torch makes it (a ``defaultdict(dict)``), counting the changes a user makes to it.

A torch user resets state by editing the mapping: ``del opt.state[p]``, ``opt.state[p] = {}``,
``opt.state.clear()``. Torch notices nothing either, it simply finds an empty entry at the next step
and starts that parameter afresh. A swapped optimizer holds host mirrors behind those entries, so it
must notice: every such edit bumps :attr:`TrackedState.version`, which the optimizer compares once
per step (one integer) instead of re-reading every entry.

An entry created by reading a missing key (``opt.state[p]`` on a new parameter, as torch's own
``_init_group`` does) is not a change: it adds an empty entry, which is what a missing one means.

Reading entries (``state[p]``, ``get``, ``items``, ``values``, ``pop``, ``copy``, ``repr``) first calls
:attr:`TrackedState.before_access`: the swapped optimizer sets it to wait for the copies still in flight into
and out of the host mirrors, so that a user who reads a state between steps sees the last step's values and an
edit in place (``opt.state[p]["exp_avg"].mul_(0.5)``) is not overwritten by a copy landing after it. Python's
own fast paths over a dict (``dict(state)``, ``{**state}``) read without it.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = ["TrackedState"]

_ABSENT: Any = object()

StateEntries = Mapping[torch.Tensor, dict[str, Any]] | Iterable[tuple[torch.Tensor, dict[str, Any]]]


class TrackedState(defaultdict[torch.Tensor, dict[str, Any]]):
    """A ``defaultdict(dict)`` whose :attr:`version` grows with every insertion, replacement or removal."""

    def __init__(self, entries: StateEntries = ()) -> None:
        super().__init__(dict, entries)
        self.version = 0
        self.before_access: Callable[[], None] | None = None
        """Called before an entry is read (see the module docstring); ``None``: nothing to wait for."""

    def _accessed(self) -> None:
        hook = self.before_access
        if hook is not None:
            hook()

    def __getitem__(self, key: torch.Tensor) -> dict[str, Any]:
        self._accessed()
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._accessed()
        return super().get(key, default)

    def items(self) -> Any:
        self._accessed()
        return super().items()

    def values(self) -> Any:
        self._accessed()
        return super().values()

    def copy(self) -> TrackedState:
        self._accessed()
        return TrackedState(dict.items(self))

    def __repr__(self) -> str:
        self._accessed()
        return f"{type(self).__name__}({dict.__repr__(self)})"

    def __reduce__(self) -> Any:
        # defaultdict's reduce passes default_factory to the constructor; this one takes only entries (no hook).
        return (type(self), (list(self.items()),))

    def __missing__(self, key: torch.Tensor) -> dict[str, Any]:
        value: dict[str, Any] = {}
        dict.__setitem__(self, key, value)
        return value

    def __setitem__(self, key: torch.Tensor, value: dict[str, Any]) -> None:
        super().__setitem__(key, value)
        self.version += 1

    def __delitem__(self, key: torch.Tensor) -> None:
        super().__delitem__(key)
        self.version += 1

    def __ior__(self, other: Any) -> TrackedState:  # type: ignore[misc,override]
        self.update(other)
        return self

    def clear(self) -> None:
        super().clear()
        self.version += 1

    def pop(self, key: torch.Tensor, *default: Any) -> Any:
        self._accessed()
        self.version += 1
        return super().pop(key, *default)

    def popitem(self) -> tuple[torch.Tensor, dict[str, Any]]:
        self._accessed()
        self.version += 1
        return super().popitem()

    def setdefault(self, key: torch.Tensor, default: dict[str, Any] | None = None) -> dict[str, Any]:
        if key in self:
            return self[key]
        self[key] = {} if default is None else default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        super().update(*args, **kwargs)
        self.version += 1

    def move_to_end(self, keys: Iterable[torch.Tensor]) -> None:
        """Move the entries of ``keys`` to the end, in that order, without counting as a change (same entries).

        ``state_dict()`` lists states in this mapping's order: entries a step created out of parameter order
        (batches walked in reverse) are put in the order torch's own step would have created them.
        """
        for key in keys:
            dict.__setitem__(self, key, dict.pop(self, key))

    @contextlib.contextmanager
    def lent(self, entries: Sequence[tuple[torch.Tensor, dict[str, Any]]]) -> Iterator[None]:
        """``entries`` in this mapping for the duration, without counting as a change.

        For tensors that stand in for parameters during an update (their fp32 masters, which the
        optimizer's own ``step`` reads its states by): the entries go when the block ends, whatever
        happens in it, and the version is as it was.
        """
        before = [(key, dict.get(self, key, _ABSENT)) for key, _ in entries]
        for key, value in entries:
            dict.__setitem__(self, key, value)
        try:
            yield
        finally:
            for key, value in before:
                if value is _ABSENT:
                    dict.pop(self, key, None)
                else:
                    dict.__setitem__(self, key, value)
