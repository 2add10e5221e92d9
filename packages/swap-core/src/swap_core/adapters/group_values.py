"""Param group values that an optimizer's own code writes, when it runs share by share.

Most optimizers only read their groups' options during ``step()``. Some write them (schedule-free
AdamW counts steps in ``group["k"]`` and sums weights in ``group["weight_sum"]``): run once per
batch, such a step would count one step per batch. :class:`GroupValues` remembers every non-
``params`` value when the step begins, puts it back before each later batch, and checks that each
batch wrote exactly what the first one wrote, so that the groups end as one plain step leaves them.
swap-generic runs a step batch by batch this way, and master weights run a method outside ``step()``
one parameter at a time (:func:`~swap_core.master_weights.outside_step_on_masters`).

A share that holds the parameters of one group only (``after_batch(..., held=group)``) runs the step over the other
groups emptied, which a plain step never does: an optimizer that writes its bookkeeping only for a group with
parameters to update (``if not params: continue``) writes nothing there. So for each group, what counts is what the
shares that held its parameters wrote (they must agree); the writes of a share that held none of them count only until
a share that holds some writes that group, and are put back at once: after each share, each group holds what the
shares that held its parameters wrote.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch

from ..errors import UnsupportedOptimizerError
from ..torch_compat import tensor_version

__all__ = ["GroupValues", "Refusal", "same_value"]

Refusal = Callable[[str], Exception]
"""Makes the error raised when a later share wrote other values than the first, from a sentence naming them."""

_ABSENT = object()
"""A key the step deleted (or, in a snapshot, one the group did not have)."""


class GroupValues:
    """The non-``params`` values of every param group at the start of one step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        method: str = "step",
        share: str = "batch",
        refusal: Refusal | None = None,
    ) -> None:
        """``method`` of ``optimizer`` runs once per ``share``; ``refusal`` makes the error of a share that wrote
        other values than the first (default: a step that is not per-parameter, which cannot run batch by batch)."""
        self._optimizer = optimizer
        self._method, self._share = method, share
        self._refusal = refusal if refusal is not None else _not_per_parameter
        self._groups = list(optimizer.param_groups)
        self._start = [_values(group) for group in self._groups]
        # Tensor values may be written in place: their start values are kept (a few scalars, e.g. a tensor lr).
        self._start_tensors = [
            {
                key: (value.clone(), tensor_version(value))
                for key, value in start.items()
                if isinstance(value, torch.Tensor)
            }
            for start in self._start
        ]
        # The common case, nothing written, is told by identity alone: C-level passes over each group's keys
        # and values (``params`` included: each batch's step has put the original list back before the check).
        self._unchanged = [
            (group, tuple(group), tuple(group.values()), [(group[key], saved[1]) for key, saved in tensors.items()])
            for group, tensors in zip(self._groups, self._start_tensors, strict=True)
        ]
        self._written_in_place: list[set[str]] = []
        """Per group, the keys whose tensor the first batch wrote in place."""
        self._written: list[dict[str, Any]] | None = None
        """What the first batch wrote, per group (tensors written in place: a copy of what they hold); for a group
        that batch held no parameter of, what the first batch that held some wrote, once one did."""
        self._held_by: list[bool] = []
        """Per group, whether :attr:`_written` of it comes from a batch that held its parameters."""
        self._touched: list[set[str]] = [set() for _ in self._groups]
        """Per group, the keys any batch wrote beyond what :attr:`_written` holds (put back before each batch)."""

    def before_batch(self) -> None:
        """Put back every value the first batch wrote (nothing to do before the first one)."""
        if not self._written:
            return
        for index in range(len(self._groups)):
            self._put_back(index)

    def _put_back(self, index: int) -> None:
        """Group ``index``'s values as the step began, for every key a batch wrote."""
        group, start, tensors = self._groups[index], self._start[index], self._start_tensors[index]
        written = self._written[index] if self._written else {}
        for key in written.keys() | self._touched[index]:
            original = start.get(key, _ABSENT)
            if original is _ABSENT:
                group.pop(key, None)
            elif key in tensors and group.get(key) is original:
                saved, _ = tensors[key]
                group[key].copy_(saved)  # the same tensor, written in place
            else:
                group[key] = original

    def put_back_start(self) -> None:
        """Every group as the step found it (a step that failed part-way): each value the step began with, written
        back (tensors in place), and each key the step added removed."""
        for group, start, tensors in zip(self._groups, self._start, self._start_tensors, strict=True):
            for key in [key for key in group if key != "params" and key not in start]:
                del group[key]
            for key, original in start.items():
                if key in tensors and group.get(key) is original:
                    saved, _ = tensors[key]
                    group[key].copy_(saved)  # the same tensor, written in place
                else:
                    group[key] = original

    def after_batch(self, batch_index: int, *, held: dict[str, Any] | None = None) -> None:
        """Record the first batch's writes; refuse a later batch that wrote anything else. ``held``: the one group
        whose parameters the batch held (the others emptied), or ``None`` (every group's, as given)."""
        holders = [held is None or group is held for group in self._groups]
        if not self._written and self._untouched():
            # Nothing written (the usual case): later batches skip every restore.
            self._held_by = holders if self._written is None else list(map(operator.or_, self._held_by, holders))
            self._written = []
            return
        writes = list(map(self._writes, range(len(self._groups))))
        if self._written is None:
            self._held_by = holders
            self._written_in_place = list(map(self._in_place, range(len(writes)), writes))
            self._written = [_kept(group) for group in writes]
            if not any(self._written):
                self._written = []  # nothing written: later batches skip every restore and compare
            return
        expected = self._written or [{} for _ in self._groups]
        for index, (wrote, first) in enumerate(zip(writes, expected, strict=True)):
            if holders[index] != self._held_by[index]:
                self._follow_holder(index, wrote, held=holders[index])
                continue
            for key in sorted(set(wrote) | set(first), key=str):
                if not same_value(wrote.get(key, _ABSENT), first.get(key, _ABSENT)):
                    raise self._refusal(
                        f"{type(self._optimizer).__name__}.{self._method} wrote param group {index}'s {key!r} as "
                        f"{_show(first.get(key, _ABSENT))} for the first {self._share} and as "
                        f"{_show(wrote.get(key, _ABSENT))} for {self._share} {batch_index}"
                    )

    def _follow_holder(self, index: int, wrote: dict[str, Any], *, held: bool) -> None:
        """Group ``index`` was written by a batch that held its parameters where the one recorded did not, or the
        reverse: the holder's writes are the ones kept, and the group holds them again at once."""
        self._touched[index].update(wrote)
        if held:
            written = self._written or [{} for _ in self._groups]
            in_place = self._written_in_place or [set() for _ in self._groups]
            written[index], in_place[index] = _kept(wrote), self._in_place(index, wrote)
            self._written, self._written_in_place = written, in_place
            self._held_by[index] = True
        elif wrote or (self._written and self._written[index]):
            # A batch over none of the group's parameters, after one over some: not what torch's step does.
            self._put_back(index)
            self._rewrite(index)

    def _in_place(self, index: int, wrote: dict[str, Any]) -> set[str]:
        """The keys of ``wrote`` whose tensor is the one group ``index`` started with (written in place)."""
        start = self._start[index]
        return {key for key, value in wrote.items() if isinstance(value, torch.Tensor) and value is start.get(key)}

    def put_back_first_writes(self) -> None:
        """Every group as the first share left it (a later share failed): the start values, then what the first
        share wrote (a tensor it wrote in place gets those values again, in place)."""
        self.before_batch()
        for index in range(len(self._written or [])):
            self._rewrite(index)

    def _rewrite(self, index: int) -> None:
        """What :attr:`_written` holds of group ``index``, written into it again."""
        assert self._written is not None
        group, start, in_place = self._groups[index], self._start[index], self._written_in_place[index]
        for key, value in self._written[index].items():
            if value is _ABSENT:
                group.pop(key, None)
            elif key in in_place:
                start[key].copy_(value)
            else:
                group[key] = value

    def _untouched(self) -> bool:
        """Whether every group holds the very keys and values the step started with (tensors not written)."""
        for group, keys, values, versions in self._unchanged:
            if len(group) != len(keys) or not all(map(operator.is_, group.values(), values)):
                return False
            if not all(map(operator.is_, group, keys)):
                return False
            if versions and any(tensor_version(tensor) != version for tensor, version in versions):
                return False
        return True

    def _writes(self, index: int) -> dict[str, Any]:
        """The values group ``index`` holds now that differ from the step's start values."""
        group, start, tensors = self._groups[index], self._start[index], self._start_tensors[index]
        writes: dict[str, Any] = {}
        for key, value in group.items():
            if key == "params":
                continue
            original = start.get(key, _ABSENT)
            if value is original:
                if key in tensors and tensor_version(value) != tensors[key][1]:
                    writes[key] = value  # written in place
            elif not same_value(value, original):
                writes[key] = value
        for key in start:
            if key not in group:
                writes[key] = _ABSENT
        return writes


def _kept(writes: dict[str, Any]) -> dict[str, Any]:
    """``writes`` as recorded: tensors copied (one written in place changes again)."""
    return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in writes.items()}


def _values(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def same_value(first: object, second: object) -> bool:
    """Equal values (NaN equal to NaN; tensors equal in shape, dtype and every element)."""
    if first is second:
        return True
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        if not (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)):
            return False
        return first.dtype == second.dtype and bool(torch.equal(first, second))
    if isinstance(first, float) and isinstance(second, float) and math.isnan(first) and math.isnan(second):
        return True
    if type(first) is not type(second):
        return False
    if isinstance(first, (tuple, list)):
        assert isinstance(second, (tuple, list))
        return len(first) == len(second) and all(map(same_value, first, second))
    try:
        return bool(first == second)
    except Exception:  # a value whose == is not a truth value (an array): unequal unless identical
        return False


def _not_per_parameter(sentence: str) -> Exception:
    return UnsupportedOptimizerError(
        f"{sentence}: its step is not per-parameter, so it cannot run batch by batch; it needs a dedicated adapter "
        "(swap_core.register_adapter)"
    )


def _show(value: object) -> str:
    return "(no value)" if value is _ABSENT else repr(value)
