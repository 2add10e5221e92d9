"""State keys the runtime itself makes, and what a state still to be created looks like."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MASTER_KEY", "is_fresh"]

MASTER_KEY = "master_param"
"""The state key of a parameter's fp32 master copy (``SwapConfig(master_weights=True)``)."""


def is_fresh(state: Mapping[str, Any]) -> bool:
    """Whether the update is still to create ``state`` (empty, or holding only its master, made first)."""
    return not state or (len(state) == 1 and MASTER_KEY in state)
