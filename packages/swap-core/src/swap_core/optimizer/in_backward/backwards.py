"""Which backward a gradient hook runs in: the outer one, one nested in it, or a later one.

torch runs a reentrant backward inside the outer one (``torch.utils.checkpoint`` with ``use_reentrant=True``
recomputes a segment and runs its backward from the segment's node): each runs its own gradient accumulation, so a
parameter used by several segments (a block shared across depths) has its post-accumulate-grad hook run once per
segment, and no hook says which run is the last. A gradient accumulated in a nested backward is therefore not final
until the outer backward ends (its end is a callback queued on its graph task, which runs only when it ends without
an error). A hook of a later backward (its task id above every id seen, once the outer one ended or from a top-level
backward) means the loop ran a forward since: what a step begun in the earlier backward updated was visible to it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from ...torch_compat import current_backward_task, inside_reentrant_backward, queue_backward_callback

__all__ = ["BackwardWatch", "HookPlace"]


class HookPlace(enum.Enum):
    OUTER = "outer"
    """The outer backward (its gradients are final)."""
    NESTED = "nested"
    """A backward nested in the outer one (a reentrant checkpoint's): final only when the outer one ends."""
    LATER = "later"
    """A backward begun after the one a step began in."""


class BackwardWatch:
    """The backwards whose hooks ran since the last ``step()`` (made afresh at every step)."""

    def __init__(self) -> None:
        self.outer: int | None = None
        """The graph task of the outer backward (``None`` before its first hook)."""
        self.outer_ended = False
        """Whether the outer backward ended without an error."""
        self._highest = -1
        self._nested: dict[int, bool] = {}

    def place(self, on_outer_end: Callable[[], None]) -> HookPlace:
        """Where the hook running now belongs; at the outer backward's first hook, ``on_outer_end`` is queued to run
        when it ends."""
        task = current_backward_task()
        nested = self._nested.get(task)
        if nested is None:
            nested = self._nested[task] = inside_reentrant_backward()
        later = self.outer_ended or (self.outer is not None and task > self._highest and not nested)
        self._highest = max(self._highest, task)
        if later:
            return HookPlace.LATER
        if nested:
            return HookPlace.NESTED
        if self.outer is None:
            self.outer = task
            queue_backward_callback(self._ended(on_outer_end))
        return HookPlace.OUTER

    def _ended(self, on_outer_end: Callable[[], None]) -> Callable[[], None]:
        def ended() -> None:
            self.outer_ended = True
            on_outer_end()

        return ended
