"""The wrapped optimizer's param groups narrowed to one share around each run of its own code.

For each pipeline batch (swap-generic's step), or each parameter (a method run outside ``step()``
over fp32 masters), the share's group gets the share of its parameters as ``"params"`` and every
other group an empty list; the optimizer's own code runs, and the original list objects are put
back afterwards, whatever happens. Group dicts keep their identity (LR schedulers write
``group["lr"]``). This runs once per share, so what can be is prepared once.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from ..errors import UnsupportedOptimizerError

__all__ = ["NarrowedGroups"]

_PARAMS = operator.itemgetter("params")


class NarrowedGroups:
    """The groups and their ``"params"`` lists as one step found them; :meth:`run` narrows them for one batch."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, method: str = "step") -> None:
        """``method``: what runs narrowed, as a refusal names it."""
        self._optimizer = optimizer
        self._method = method
        self._groups = optimizer.param_groups
        self._members = list(self._groups)
        self._originals = list(map(_PARAMS, self._members))

    def run(self, step: Callable[[], Any], target: dict[str, Any] | None, params: list[torch.Tensor]) -> Any:
        """``step()`` with ``target``'s params narrowed to ``params`` and every other group's empty; what it returns.

        Refuses a step that added, removed or re-listed parameters or groups (after putting the groups back).
        """
        # A copy: a step that edits its list (refused below) must not edit the runtime's batch list.
        share = list(params)
        size = len(share)
        kept = False
        try:
            for group in self._members:
                group["params"] = share if group is target else []
            result = step()
            kept = self._kept(target, share, size)
        finally:
            self._restore(groups_too=not kept)  # a step that raised may have edited the groups as well
        if not kept:
            raise UnsupportedOptimizerError(
                f"{type(self._optimizer).__name__}.{self._method} changed param_groups (added, removed or replaced "
                f"parameters or groups): the {self._method} runs share by share over a part of each group, which "
                "such a change would corrupt. Edit param_groups between steps instead"
            )
        return result

    def _kept(self, target: dict[str, Any] | None, share: list[torch.Tensor], size: int) -> bool:
        """Whether the groups are the ones given, ``target`` holding ``share`` (still ``size`` long), the others
        nothing."""
        groups, members = self._optimizer.param_groups, self._members
        if groups is not self._groups or len(groups) != len(members) or len(share) != size:
            return False
        if target is not None and target["params"] is not share:
            return False
        if len(members) == 1:  # the usual optimizer: its one group holds exactly ``share``
            return groups[0] is members[0] and (target is not None or not groups[0]["params"])
        return all(map(operator.is_, groups, members)) and sum(map(len, map(_PARAMS, groups))) == size

    def _restore(self, *, groups_too: bool) -> None:
        """Put the original ``"params"`` lists back and, with ``groups_too``, the group list and its dicts."""
        for group, original in zip(self._members, self._originals):  # noqa: B905 (built the same length)
            group["params"] = original
        if groups_too:
            self._groups[:] = self._members
            self._optimizer.param_groups = self._groups
