"""Warnings that point at the user's line: the first frame outside swap's packages and torch's."""

from __future__ import annotations

import inspect
import warnings

__all__ = ["warn_user"]

_LIBRARY_TOPS = frozenset({"swap_core", "torch"})
"""Top-level packages whose frames stand between the user's call and the warning (torch's: ``no_grad``,
``compiler.disable`` and the profiler's step wrapper around ``step()``)."""


def warn_user(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)`` attributed to the user's code that called into swap, however many
    library frames (swap's own rooms, torch's decorators) lie between."""
    level = 2  # warnings.warn(stacklevel=2) names the caller of warn_user, the frame looked at first
    frame = inspect.currentframe()
    frame = frame.f_back if frame is not None else None
    while frame is not None and str(frame.f_globals.get("__name__", "")).split(".")[0] in _LIBRARY_TOPS:
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
