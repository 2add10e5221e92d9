"""The update run on the fp32 masters: chosen once at wrapping, and presented to an optimizer's own methods."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..adapters.base import StateSwapAdapter, UpdateBatch
from ..dtensor import local_tensor, shard_layout, wrap_local
from ..errors import SwapStateError
from ..runtime.state_keys import MASTER_KEY, MASTER_KEYS, REMAINDER_KEY
from ..runtime.tracked_state import TrackedState
from .params import MASTER_DTYPE, MasterPair, has_master, listed_keys, stand_in, without_master
from .remainder import MasterRemainder, rebuild_master, split_master

__all__ = ["OnMasters", "UpdateOnMasters", "masters_presented", "on_masters", "params_as_masters"]


@dataclasses.dataclass
class OnMasters:
    """What one update of a batch segment runs on in master-weights mode (see :func:`on_masters`)."""

    params: list[torch.Tensor]
    """Each low-precision parameter's master (its device copy during the batch); fp32 parameters as they are."""
    grads: list[torch.Tensor]
    """The gradients, those of the masters' parameters upcast to fp32."""
    states: list[dict[str, Any]]
    """The states without their master: copies for the masters' parameters (their writes go back with
    :meth:`write_back`), the state dicts themselves for fp32 parameters."""
    model_params: list[torch.Tensor]
    """The parameters, as the model holds them."""
    pairs: list[MasterPair]
    """``(parameter, master)`` of each parameter to set from its master once the update ran."""
    _copies: list[tuple[dict[str, Any], dict[str, Any]]]
    _remainders: dict[int, MasterRemainder] = dataclasses.field(default_factory=dict)
    """The device copy of the remainder each master in remainder form was rebuilt from, by the master's id: the
    updated master is split back into it."""

    def write_back(self) -> None:
        """What the update wrote to the state copies, into the state dicts (keys set, replaced or removed)."""
        for state, copied in self._copies:
            for key, value in copied.items():
                if state.get(key) is not value:
                    state[key] = value
            for key in [key for key in state if key not in MASTER_KEYS and key not in copied]:
                del state[key]

    def set_params(self) -> None:
        """``param.copy_(master)`` for each pair: the parameter rounds its updated master to nearest even; a master
        in remainder form is then split back into its remainder (the bits the parameter lacks)."""
        with torch.no_grad():
            for param, master in self.pairs:
                param.copy_(master)
                remainder = self._remainders.get(id(master))
                if remainder is not None:
                    split_master(local_tensor(master), local_tensor(param.detach()), out=remainder)


def on_masters(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], states: Sequence[dict[str, Any]]
) -> OnMasters:
    """What the update runs on: each low-precision parameter's master and its gradient in fp32.

    Other parameters (fp32 ones) pass unchanged. The masters are the device copies ``states``
    hold during the batch. The update sees each master's state without the master itself (an
    optimizer's own step would take an unknown key for a state it has to create, or refuse it);
    :meth:`OnMasters.write_back` then keeps what it wrote, and :meth:`OnMasters.set_params` sets the
    parameters from their updated masters.
    """
    update_params: list[torch.Tensor] = []
    update_grads: list[torch.Tensor] = []
    update_states: list[dict[str, Any]] = []
    pairs: list[MasterPair] = []
    copies: list[tuple[dict[str, Any], dict[str, Any]]] = []
    remainders: dict[int, MasterRemainder] = {}
    for param, grad, state in zip(params, grads, states, strict=True):
        if not has_master(param):
            update_params.append(param)
            update_grads.append(grad)
            update_states.append(state)
            continue
        master = state.get(MASTER_KEY)
        packed = state.get(REMAINDER_KEY)
        if isinstance(packed, torch.Tensor) and master is None:
            local = local_tensor(param.detach())
            remainder = MasterRemainder.packed(packed, local.numel())
            master = wrap_local(rebuild_master(local, remainder), shard_layout(param))
            remainders[id(master)] = remainder
        if not isinstance(master, torch.Tensor):  # never update the low-precision parameter itself instead
            raise SwapStateError(
                f"The {param.dtype} parameter of shape {tuple(param.shape)} has no {MASTER_KEY!r} in its state "
                f"(it has {listed_keys(state)}): master weights cannot update it (the step checks every state before "
                "any batch; was the state edited during the step?)"
            )
        copied = without_master(state)
        update_params.append(master)
        update_grads.append(grad.to(MASTER_DTYPE))
        update_states.append(copied)
        pairs.append((param, master))
        copies.append((state, copied))
    return OnMasters(update_params, update_grads, update_states, list(params), pairs, copies, remainders)


class UpdateOnMasters:
    """``adapter``'s update run on the fp32 masters of each batch's bf16/fp16 parameters, which then follow their
    masters (see :func:`on_masters`); the adapter's ``update`` is looked up at each call."""

    def __init__(self, adapter: StateSwapAdapter) -> None:
        self.adapter = adapter

    def update(self, batch: UpdateBatch) -> None:
        masters = on_masters(batch.params, batch.grads, batch.states)
        try:
            self.adapter.update(
                UpdateBatch(batch.group, masters.params, masters.grads, masters.states, batch.batch_index, batch.params)
            )
        finally:
            masters.write_back()
        masters.set_params()


@contextlib.contextmanager
def masters_presented(optimizer: torch.optim.Optimizer, batch: UpdateBatch) -> Iterator[None]:
    """For an adapter that runs the optimizer's own ``step`` over ``batch.params``: the masters look like parameters.

    In master-weights mode (``batch.model_params`` set), each master has its fp32 gradient as
    ``.grad`` and its state as its entry in ``optimizer.state`` for the duration, as a parameter of
    the plain optimizer over fp32 masters would; both go when the block ends, whatever happens.
    Otherwise nothing changes (the parameters are the optimizer's own).
    """
    if batch.model_params is None:
        yield
        return
    lent: list[tuple[torch.Tensor, dict[str, Any]]] = []
    for update, param, grad, state in zip(batch.params, batch.model_params, batch.grads, batch.states, strict=True):
        if update is not param:
            update.grad = grad
            lent.append((update, state))
    entries = optimizer.state
    if not isinstance(entries, TrackedState):
        raise TypeError(
            f"masters_presented needs the state of an optimizer a SwapOptimizer wraps, got a {type(entries).__name__}"
        )
    try:
        with entries.lent(lent):
            yield
    finally:
        for master, _ in lent:
            master.grad = None


@contextlib.contextmanager
def params_as_masters(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """For an optimizer's own ``load_state_dict``: its param groups list fp32 stand-ins of the low-precision params.

    Such a method casts each loaded floating state to its parameter's dtype (bitsandbytes' does, as
    torch's does); over the stand-ins it keeps them, and the masters, in fp32, as a load into the
    plain optimizer over fp32 masters would. Afterwards the groups list the parameters again and the
    states the method keyed by stand-ins are keyed by their parameters, whatever happens.
    """
    params_of: dict[int, torch.Tensor] = {}
    originals = [group["params"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        presented = []
        for param in group["params"]:
            if has_master(param):
                fp32 = stand_in(param)
                params_of[id(fp32)] = param
                param = fp32
            presented.append(param)
        group["params"] = presented
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, originals, strict=True):
            group["params"] = params
        state = optimizer.state
        for key in [key for key in state if id(key) in params_of]:
            state[params_of[id(key)]] = state.pop(key)
