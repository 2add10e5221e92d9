"""Exact counts of the copies issued to the simulator, for tests that assert bytes and calls."""

from __future__ import annotations

from dataclasses import dataclass

from ...stats import CopyCounts

__all__ = ["CopyStats"]


@dataclass
class CopyStats(CopyCounts):
    """Copies and bytes per direction, counted when a copy is issued (not when a lazy queue runs it); device to
    device copies too."""

    d2d_copies: int = 0
    d2d_bytes: int = 0

    def add(self, direction: str, nbytes: int) -> None:
        """Count one copy of ``nbytes`` bytes in ``direction`` (``"h2d"``, ``"d2h"`` or ``"d2d"``)."""
        if direction == "d2d":
            self.d2d_copies += 1
            self.d2d_bytes += nbytes
        else:
            self.count(direction, 1, nbytes)
