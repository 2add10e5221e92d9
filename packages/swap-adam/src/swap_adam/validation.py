"""What the Adam adapter refuses, and why, before it touches any state.

Swapping replaces ``Adam.step`` with per-batch calls of ``torch.optim.adam.adam``,
so it is exact only when the optimizer's step *is* torch's Adam step and its
state holds only the keys that step knows. Everything here runs at wrap time
(or when a param group added later gets its first state), raises
:class:`~swap_core.errors.UnsupportedOptimizerError`, and modifies nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from swap_core.adapters import refuse_differentiable
from swap_core.errors import UnsupportedOptimizerError

__all__ = [
    "ADAM_STATE_KEYS",
    "check_group",
    "check_optimizer",
    "check_state_keys",
]

ADAM_STATE_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
"""Every state key ``torch.optim.Adam`` / ``AdamW`` create."""


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Everything that must hold before ``optimizer`` is wrapped; raises without modifying it.

    (That its class runs torch's own ``step`` and ``_init_group`` is checked by swap-core, from
    :attr:`AdamAdapter.reproduces <swap_core.StateSwapAdapter.reproduces>`.)
    """
    for index, group in enumerate(optimizer.param_groups):
        check_group(group, index, type(optimizer))
    check_state_keys(optimizer)


def check_group(group: Mapping[str, Any], index: int | None, optimizer_cls: type[torch.optim.Optimizer]) -> None:
    """Options of one param group that swapping cannot support (``differentiable=True``)."""
    refuse_differentiable(optimizer_cls.__name__, group, index)


def check_state_keys(optimizer: torch.optim.Optimizer) -> None:
    """Existing state may hold only Adam's keys: an unknown one belongs to math the adapter does not run."""
    unknown = sorted({str(key) for state in optimizer.state.values() for key in state if key not in ADAM_STATE_KEYS})
    if unknown:
        optimizer_cls = type(optimizer)
        raise UnsupportedOptimizerError(
            f"{_qualname(optimizer_cls)} has state keys {unknown} that torch.optim.Adam does not create "
            f"(Adam's are {sorted(ADAM_STATE_KEYS)}); swap-adam's AdamAdapter would ignore them. Register an "
            f"adapter that knows them: swap_core.register_adapter({optimizer_cls.__name__}, factory, name=...)"
        )


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
