"""Muon for DTensor (FSDP2 / HSDP) parameters: whole-matrix math on one owner rank per parameter.

Running Muon on each rank's local shard is wrong: Newton-Schulz must see the
whole matrix. Per pipeline batch:

1. the gradient shards of all its parameters go to their owners (shard-group
   ranks) in one ``all_to_all``;
2. each owner updates its full-size momentum, which only it holds (swapped to its
   host memory by swap-core like any state), and orthogonalizes;
3. the updates come back in one ``all_to_all`` and every rank applies its own
   rows, with the same elementwise ops as ``torch.optim.Muon``.

Every rank walks the same batches (the adapter gives swap-core rank-independent
costs) and issues the same collectives in the same order. With HSDP the plan
lives inside the shard group; each replica group repeats it on identical data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Muon

from swap_core import StateInit, StateSwapAdapter, UpdateBatch
from swap_core.errors import UnsupportedOptimizerError
from swap_core.master_weights import model_param

from .owner_checkpoint import gather_owner_momentum, scatter_owner_momentum
from .owner_plan import OwnerPlan, plan_owners, state_bytes
from .row_exchange import gather_rows_to_owners, scatter_rows_from_owners
from .shard_group import ShardGroup, shard_group_of
from .torch_compat import adjust_lr, zeropower_via_newtonschulz

__all__ = ["DistributedMuonAdapter", "PlanMismatchError", "ShardGroup", "shard_group_of"]


class PlanMismatchError(UnsupportedOptimizerError):
    """Ranks computed different owner plans (different parameters or order): collectives would hang."""


class DistributedMuonAdapter(StateSwapAdapter):
    """Owner-rank Muon over sharded parameters, bitwise equal to ``torch.optim.Muon`` on full tensors."""

    swappable_keys = ("momentum_buffer",)
    reproduces = (Muon,)

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        params = [param for group in optimizer.param_groups for param in group["params"]]
        if not params:
            raise UnsupportedOptimizerError("Distributed Muon got no parameters")
        self.shards = shard_group_of(params)
        self._position = {id(param): index for index, param in enumerate(params)}
        self._planned = _kinds(params)
        self.plan: OwnerPlan = plan_owners(
            [shape for shape, _ in self._planned], [dtype for _, dtype in self._planned], self.shards.size
        )
        _check_same_plan(self.plan)
        self._step_lrs: dict[int, float] = {}
        """Each param group's learning rate for the step running now (by the group's identity)."""

    def params_changed(self, params: Sequence[torch.Tensor]) -> None:
        """New parameter objects of the same shapes and dtypes, in the same order, keep the owner plan."""
        kinds = _kinds(params)
        if kinds != self._planned:
            raise UnsupportedOptimizerError(
                f"Distributed Muon assigned owner ranks to its {len(self._planned)} parameters when it was wrapped; "
                f"the param groups now hold {len(kinds)} parameters of other shapes, dtypes or order, and every rank "
                "would need a new plan. Wrap a new optimizer over the new parameters"
            )
        self._position = {id(param): index for index, param in enumerate(params)}

    def owner_of(self, param: torch.Tensor) -> int:
        """Shard-group rank that owns ``param`` (or the parameter an fp32 stand-in of master weights stands for)."""
        return self.plan.owners[self._position[id(model_param(param))]]

    def initial_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor | StateInit]:
        if self.owner_of(param) != self.shards.rank:
            return {}
        return {"momentum_buffer": StateInit(tuple(param.shape), param.dtype, 0.0, shard_like_param=False)}

    def step_scope(self) -> contextlib.AbstractContextManager[None]:
        """Each param group's learning rate read once per step: a tensor ``lr`` is one host read (``.item()``, a
        device sync where it lives on the device) per group and step, as ``torch.optim.Muon``'s own step reads
        it, not one per batch."""
        return self._learning_rates_of_this_step()

    @contextlib.contextmanager
    def _learning_rates_of_this_step(self) -> Iterator[None]:
        self._step_lrs = {id(group): _scalar(group["lr"]) for group in self.optimizer.param_groups}
        try:
            yield
        finally:
            self._step_lrs = {}

    def partition_costs(self, params: Sequence[torch.Tensor]) -> Sequence[int]:
        return [state_bytes(param.shape, param.dtype) for param in params]

    def agree_on_batches(self, batches: int) -> int:
        """The largest count any rank of the shard group needs (an all-reduce of one integer, at a re-plan: every
        rank of the group walks the same batches and runs their row exchanges together)."""
        device = torch.device("cpu")
        if dist.get_backend(self.shards.group) != "gloo":
            first = next(param for group in self.optimizer.param_groups for param in group["params"])
            device = first.to_local().device  # a DTensor: NCCL/HCCL reduce on the device
        count = torch.tensor([batches], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.shards.group)
        return int(count.item())

    def update(self, batch: UpdateBatch) -> None:
        """One batch: gradients to the owners, their momentum steps and Newton-Schulz, the rows back.

        With master weights, ``batch.params`` are the fp32 masters (sharded like their parameters, whose
        owners they keep) and the gradients fp32: the owner's momentum is fp32, as ``torch.optim.Muon``'s
        over fp32 masters, and every rank applies its rows of the update to its shard of the master.
        """
        group = batch.group
        lr = self._step_lrs.get(id(group))
        if lr is None:  # an update outside a step's scope
            lr = _scalar(group["lr"])
        owners = [self.owner_of(param) for param in batch.model_params or batch.params]
        full_grads = self._gather_to_owners(batch.params, batch.grads, owners)
        updates = [
            None if full_grad is None else _owner_update(full_grad, state["momentum_buffer"], group)
            for full_grad, state in zip(full_grads, batch.states, strict=True)
        ]
        local_updates = self._scatter_from_owners(batch.params, updates, owners)
        for param, local_update in zip(batch.params, local_updates, strict=True):
            adjusted_lr = adjust_lr(lr, group["adjust_lr_fn"], param.shape)
            local = param.to_local()  # type: ignore[attr-defined]
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(local_update, alpha=-adjusted_lr)

    # -- checkpoint layout (collective: every rank of the shard group calls these) ---
    def export_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Owners' full momentum scattered into every rank's DTensor shard (torch.optim.Muon's layout)."""
        return scatter_owner_momentum(state_dict, self.optimizer.param_groups, self.plan.owners, self.shards)

    def import_state_dict(self, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
        """Loaded momentum shards (or whole tensors) gathered whole onto this plan's owners."""
        return gather_owner_momentum(state_dict, self.optimizer.param_groups, self.plan.owners, self.shards)

    # -- collectives ------------------------------------------------------------
    def _gather_to_owners(
        self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], owners: Sequence[int]
    ) -> list[torch.Tensor | None]:
        """Full gradients on their owners (``None`` elsewhere): one ``all_to_all`` for the whole batch."""
        return gather_rows_to_owners(
            [grad.to_local() for grad in grads],  # type: ignore[attr-defined]
            [param.shape for param in params],
            owners,
            self.shards.group,
        )

    def _scatter_from_owners(
        self, params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor | None], owners: Sequence[int]
    ) -> list[torch.Tensor]:
        """Each rank's rows of each owner's update: one ``all_to_all`` for the whole batch."""
        return scatter_rows_from_owners(
            updates,
            [param.shape for param in params],
            torch.bfloat16,  # Newton-Schulz returns bfloat16, whatever the parameter's dtype
            owners,
            self.shards.group,
            _local_device(params[0]),
        )


def _owner_update(full_grad: torch.Tensor, buffer: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """The momentum step and orthogonalization of ``torch.optim.Muon``, on the whole matrix."""
    buffer.lerp_(full_grad, 1 - group["momentum"])
    update = full_grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer
    orthogonalized: torch.Tensor = zeropower_via_newtonschulz(
        update, group["ns_coefficients"], group["ns_steps"], group["eps"]
    )
    return orthogonalized


def _scalar(lr: float | torch.Tensor) -> float:
    """A learning rate as a Python float (a tensor ``lr`` is read from wherever it lives)."""
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


def _kinds(params: Sequence[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(param.shape), param.dtype) for param in params]


def _local_device(param: torch.Tensor) -> torch.device:
    local: torch.Tensor = param.to_local()  # type: ignore[attr-defined]
    return local.device


def _check_same_plan(plan: OwnerPlan) -> None:
    """Every rank must have derived the same plan; otherwise fail on all ranks instead of hanging later."""
    fingerprints: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(fingerprints, plan.fingerprint)
    differing = sorted({rank for rank, seen in enumerate(fingerprints) if seen != fingerprints[0]})
    if differing:
        raise PlanMismatchError(
            f"Distributed Muon owner plans differ between ranks (rank 0: {fingerprints[0]}, ranks {differing} "
            "differ): every rank must build the optimizer over the same parameters in the same order"
        )
