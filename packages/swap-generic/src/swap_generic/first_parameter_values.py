"""Values of a whole param group that an optimizer keeps in the state of the group's first parameter (a step count).

A collection of modern optimizers counts a group's steps in ``state[group["params"][0]]["step"]`` and reads that count
for every parameter of the group. swap-generic runs the step over one share of a group at a time, whose first
parameter is the share's own: left alone, the first parameter of each share would count in its own state. So, for one
step, :class:`FirstParameterValues` takes those values as the group's first parameter held them when the step began,
and lends a copy of them to the first parameter of every share for its run (a value of that key its own state holds
is put aside meanwhile: torch's step never reads it). After the run it takes back what the share left there. The
shares must agree, bitwise: else the value is not the group's (a sum over the group's gradients), and the step is
refused. The group's first parameter ends with that value:

- its own share leaves it in its state;
- a share that holds it, not first, or any share while it has no gradient (then it is in no share, and torch's step
  counts for the group all the same), writes it there. The runtime keeps that entry with the share's
  (:meth:`~swap_core.adapters.StateSwapAdapter.entries_written_beside`), so that a failed step's journal and a
  take-back of a step begun inside the backward put it back;
- a share that runs before the first parameter's own one writes nothing there: its own share will.

Which keys hold such values the probe tells (:attr:`~swap_generic.probe.ProbeVerdict.first_parameter_keys`): keys only
the first stand-in's state holds when stepped together, which, lent this way, leave everything as stepped together.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from swap_core.adapters import same_value
from swap_core.errors import UnsupportedOptimizerError

__all__ = ["FirstParameterValues"]


@dataclasses.dataclass
class _GroupFirst:
    """One group's first parameter, the values it held when the step began, and what the shares left so far."""

    index: int
    param: torch.Tensor
    start: dict[str, Any]
    left: dict[str, Any] | None = None
    """What the first share that ran left (every later one must leave the same)."""
    ran: bool = False
    """Whether the first parameter's own share ran (its state holds what the step leaves)."""

    def writes_beside(self, owners: Sequence[torch.Tensor]) -> bool:
        """Whether a share of ``owners`` led by another parameter writes the first parameter's entry, which is not
        among ``owners``: it has no gradient, so no share of its own will."""
        return not self.ran and self.param.grad is None and not any(owner is self.param for owner in owners)


class FirstParameterValues:
    """For one step: the values of ``keys`` each group's first parameter held when it began, lent to every share."""

    def __init__(self, optimizer: torch.optim.Optimizer, keys: frozenset[str]) -> None:
        self._optimizer_name = type(optimizer).__name__
        self._state = optimizer.state
        self._keys = keys
        self._groups: dict[int, _GroupFirst] = {}
        for index, group in enumerate(optimizer.param_groups):
            if group["params"]:
                first = group["params"][0]
                entry = self._state.get(first, {})
                start = {key: _copy(entry[key]) for key in sorted(keys) if key in entry}
                self._groups[id(group)] = _GroupFirst(index, first, start)

    def entries_written_beside(self, group: dict[str, Any], owners: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The group's first parameter when the share of ``owners`` about to run writes its entry from outside."""
        first = self._groups.get(id(group))
        if first is None or not owners or not first.writes_beside(owners):
            return []
        return [first.param]

    @contextlib.contextmanager
    def lent(
        self, group: dict[str, Any] | None, owners: Sequence[torch.Tensor], updated: Sequence[torch.Tensor]
    ) -> Iterator[None]:
        """Around the run of the share of ``group`` over ``owners`` (the model's parameters), which the step updates
        as ``updated`` (their masters, with master weights: the keys under which it finds their states): the group's
        values lent to the first."""
        first = None if group is None else self._groups.get(id(group))
        if first is None or not owners:
            yield
            return
        own = owners[0] is first.param
        # The first parameter's entry exists before the share's (torch's step makes it first, where it counts).
        self._state[first.param]  # a defaultdict: the lookup makes the entry
        entry = self._state[updated[0]]
        put_aside = {key: entry[key] for key in self._keys if key in entry}
        for key in self._keys:
            if key in first.start:
                entry[key] = _copy(first.start[key])  # in place of a value it holds: the keys keep their order
            else:
                entry.pop(key, None)
        try:
            yield
        except BaseException:
            if not own:
                _take_back(entry, self._keys, put_aside)
            raise
        left = {key: entry[key] for key in self._keys if key in entry}
        if not own:
            _take_back(entry, self._keys, put_aside)
        self._agree(first, left)
        if own:
            first.ran = True
            return
        held = next((index for index, owner in enumerate(owners) if owner is first.param), None)
        if held is not None:  # the entry the step found for it (with master weights, the one written back)
            _take_back(self._state[updated[held]], self._keys, left)
        elif first.writes_beside(owners):
            _take_back(self._state[first.param], self._keys, left)

    def _agree(self, first: _GroupFirst, left: dict[str, Any]) -> None:
        """``left`` is what every share before left, or the first share's."""
        if first.left is None:
            first.left = left
            return
        for key in sorted(self._keys):
            before, now = first.left.get(key, _ABSENT), left.get(key, _ABSENT)
            if before is not now and not same_value(before, now):
                raise UnsupportedOptimizerError(
                    f"{self._optimizer_name}'s step left {key!r} in the state of the first parameter of two shares "
                    f"of param group {first.index} differently ({_shown(before)} against {_shown(now)}), each given "
                    "the value the group's first parameter held when the step began: it is not a value of the group "
                    "(a step count), but depends on the parameters the step is given, so the step cannot run batch "
                    "by batch. Step this optimizer unswapped, or write a dedicated adapter "
                    "(swap_core.register_adapter)"
                )


_ABSENT = object()


def _copy(value: Any) -> Any:
    """A value to lend: a tensor cloned where it lives (a step may count in place), a number as it is."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _take_back(entry: dict[str, Any], keys: frozenset[str], values: dict[str, Any]) -> None:
    """``entry`` holds ``values`` for ``keys`` (set in place, the keys keeping their order), and no other key of
    ``keys``."""
    for key in keys:
        if key in values:
            entry[key] = values[key]
        else:
            entry.pop(key, None)


def _shown(value: Any) -> str:
    if value is _ABSENT:
        return "absent"
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return f"tensor({value.item()!r})"
    return repr(value)
