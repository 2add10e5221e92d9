"""Rounding sizes up to an alignment (the byte offsets of packed regions, staging arenas and exchanged pieces)."""

from __future__ import annotations

__all__ = ["align_up"]


def align_up(value: int, alignment: int) -> int:
    """``value`` rounded up to a multiple of ``alignment``."""
    return -(-value // alignment) * alignment
