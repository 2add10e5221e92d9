"""Exact counts of the copies issued to the simulator, for tests that assert bytes and calls."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CopyStats"]


@dataclass(slots=True)
class CopyStats:
    """Copies and bytes per direction, counted when a copy is issued (not when a lazy queue runs it)."""

    h2d_copies: int = 0
    d2h_copies: int = 0
    d2d_copies: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    d2d_bytes: int = 0

    def add(self, direction: str, nbytes: int) -> None:
        if direction == "h2d":
            self.h2d_copies += 1
            self.h2d_bytes += nbytes
        elif direction == "d2h":
            self.d2h_copies += 1
            self.d2h_bytes += nbytes
        else:
            self.d2d_copies += 1
            self.d2d_bytes += nbytes
