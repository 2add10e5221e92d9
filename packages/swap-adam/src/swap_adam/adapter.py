"""Adapter for ``torch.optim.Adam`` and ``torch.optim.AdamW``: swaps the moments, runs torch's own Adam.

Each batch goes through ``torch.optim.adam.adam``, the function ``Adam.step``
calls, with exactly the arguments ``Adam.step`` passes for that group, so the
single-tensor, foreach and fused implementations give the numbers torch gives.
Fresh moments are :class:`~swap_core.adapters.base.StateInit` placeholders, so
they are born in host memory and the first step needs no more device memory
than any later one; ``step`` counters stay where torch puts them.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import torch
from torch.optim.adam import adam

from swap_core.adapters.base import StateInit, StateSwapAdapter, UpdateBatch
from swap_core.adapters.registry import AdapterRegistry

from .torch_compat import default_to_fused_or_foreach, device_dtype_check_for_fused, get_scalar_dtype
from .validation import check_group, check_optimizer

__all__ = ["AdamAdapter", "register"]

# Per-state lookups of every batch (C-level getters: the update runs once per batch of up to all params).
_EXP_AVG, _EXP_AVG_SQ, _MAX_EXP_AVG_SQ, _STEP = map(itemgetter, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"))


class AdamAdapter(StateSwapAdapter):
    """Swaps ``exp_avg``, ``exp_avg_sq`` and (with amsgrad) ``max_exp_avg_sq`` of Adam and AdamW.

    Construction checks the optimizer (see :mod:`swap_adam.validation`) and
    raises :class:`~swap_core.errors.UnsupportedOptimizerError` before any
    state moves.
    """

    swappable_keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    reproduces = (torch.optim.Adam, torch.optim.AdamW)

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        check_optimizer(optimizer)
        self._foreach_choice: dict[int, tuple[tuple[object, ...], bool | None]] = {}

    def initial_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor | StateInit]:
        """``Adam._init_group``'s lazy state, with the moments as host-born placeholders."""
        check_group(group, self._group_index(group), type(self.optimizer))
        fused = group["fused"]
        if fused:
            device_dtype_check_for_fused(param)
        # torch keeps `step` on the CPU unless capturable or fused, which need it beside the params.
        if group["capturable"] or fused:
            step = torch.zeros((), dtype=get_scalar_dtype(is_fused=fused), device=param.device)
        else:
            step = torch.tensor(0.0, dtype=get_scalar_dtype(), device="cpu")
        state: dict[str, torch.Tensor | StateInit] = {
            "step": step,
            "exp_avg": StateInit.zeros_like(param),
            "exp_avg_sq": StateInit.zeros_like(param),
        }
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = StateInit.zeros_like(param)
        return state

    def update(self, batch: UpdateBatch) -> None:
        """``Adam.step`` for one group's share of a batch: same function, same arguments."""
        group = batch.group
        states = batch.states
        beta1, beta2 = group["betas"]
        foreach = self._group_foreach(group)
        # Only the foreach implementation reads has_complex (single-tensor Adam checks each parameter itself,
        # fused Adam refuses complex ones), and scanning a batch costs ~0.3 us per parameter: skip it otherwise.
        has_complex = foreach is not False and not group["fused"] and any(map(torch.is_complex, batch.params))
        adam(
            batch.params,
            batch.grads,
            list(map(_EXP_AVG, states)),
            list(map(_EXP_AVG_SQ, states)),
            list(map(_MAX_EXP_AVG_SQ, states)) if group["amsgrad"] else [],
            list(map(_STEP, states)),
            amsgrad=group["amsgrad"],
            has_complex=has_complex,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=foreach,
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            grad_scale=getattr(self.optimizer, "grad_scale", None),
            found_inf=getattr(self.optimizer, "found_inf", None),
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )

    def _group_foreach(self, group: dict[str, Any]) -> bool | None:
        """:func:`_group_foreach`, decided once per group and its options rather than once per batch.

        Scanning a 1,000-parameter group for every batch cost milliseconds per step; the decision
        only changes when the group's parameters or options do (keys below).
        """
        key = (
            len(group["params"]),
            group["foreach"],
            group["fused"],
            group["differentiable"],
            group["capturable"],
            isinstance(group["lr"], torch.Tensor),
        )
        cached = self._foreach_choice.get(id(group))
        if cached is None or cached[0] != key:
            cached = (key, _group_foreach(group))
            self._foreach_choice[id(group)] = cached
        return cached[1]

    def _group_index(self, group: dict[str, Any]) -> int | None:
        return next((index for index, known in enumerate(self.optimizer.param_groups) if known is group), None)


def _group_foreach(group: dict[str, Any]) -> bool | None:
    """The implementation torch picks for the whole group, which a batch (a subset) must not re-decide.

    With ``foreach`` and ``fused`` both unset, ``adam()`` chooses from the
    parameters it is given; deciding from all of the group's parameters with a
    gradient, as ``Adam.step`` does, keeps every batch on the same code path.
    """
    foreach: bool | None = group["foreach"]
    if foreach is not None or group["fused"] is not None:
        return foreach
    with_grad = [param for param in group["params"] if param.grad is not None]
    _, foreach = default_to_fused_or_foreach(with_grad, group["differentiable"], use_fused=False)
    # adam() keeps single-tensor Adam for a tensor lr without capturable; so must an explicit choice.
    if foreach and isinstance(group["lr"], torch.Tensor) and not group["capturable"]:
        foreach = False
    return foreach


def register(registry: AdapterRegistry) -> None:
    """Entry point of the ``swap_core.adapters`` group: serves Adam, AdamW and their subclasses."""
    registry.register(torch.optim.Adam, AdamAdapter, name="adam")
    registry.register(torch.optim.AdamW, AdamAdapter, name="adamw")
