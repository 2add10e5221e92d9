"""One-shot copy faults, so tests can check that a failure mid-step loses nothing."""

from __future__ import annotations

from swap_core.errors import SimInjectedFault

__all__ = ["COPY_DIRECTIONS", "CopyFault", "is_count"]

COPY_DIRECTIONS = ("h2d", "d2h", "d2d")
"""Directions a copy can have; a fault may count only one of them."""


class CopyFault:
    """Fires on the ``at``-th matching copy call after arming (0-based), then disarms."""

    __slots__ = ("direction", "remaining")

    def __init__(self, at: int, direction: str | None) -> None:
        if not is_count(at):
            raise ValueError(f"Invalid fault position: {at!r}; expected an int >= 0")
        if direction is not None and direction not in COPY_DIRECTIONS:
            raise ValueError(f"Invalid copy direction: {direction!r}; expected one of {COPY_DIRECTIONS} or None")
        self.remaining = at
        self.direction = direction

    def fires(self, direction: str) -> bool:
        """Count one copy call of ``direction``; True when this is the armed one."""
        if self.direction is not None and direction != self.direction:
            return False
        if self.remaining == 0:
            return True
        self.remaining -= 1
        return False

    def error(self, direction: str, nbytes: int) -> SimInjectedFault:
        counted = f"{self.direction} " if self.direction is not None else ""
        return SimInjectedFault(f"Injected fault on a {direction} copy of {nbytes} bytes (armed {counted}copy fault)")


def is_count(value: object) -> bool:
    """An int >= 0 that is not a bool (callers may pass anything at runtime)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
