"""State keys the runtime itself makes, and what a state still to be created looks like."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MASTER_KEY", "MASTER_KEYS", "REMAINDER_KEY", "is_fresh"]

MASTER_KEY = "master_param"
"""The state key of a parameter's fp32 master copy (``SwapConfig(master_weights=True)``), and the key every
checkpoint holds a master under."""

REMAINDER_KEY = "master_remainder"
"""The state key of a bf16 parameter's master kept as the bits the parameter lacks (a ``uint8`` tensor, see
:mod:`swap_core.master_weights.remainder`); ``state_dict()`` shows it as the fp32 ``"master_param"``."""

MASTER_KEYS = frozenset({MASTER_KEY, REMAINDER_KEY})
"""The keys a master is kept under, in either form."""


def is_fresh(state: Mapping[str, Any]) -> bool:
    """Whether the update is still to create ``state`` (empty, or holding only its master, made first)."""
    return not state or (len(state) == 1 and not MASTER_KEYS.isdisjoint(state))
