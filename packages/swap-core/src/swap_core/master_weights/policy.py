"""Master weights as one policy decided at wrapping (``SwapConfig.master_weights``): what the rest of swap-core asks
instead of reading a flag.

:class:`NoMasters` keeps none: every parameter is updated as it is. :class:`FP32Masters` keeps an fp32 master of every
bf16/fp16 parameter as its state ``"master_param"``, and the update runs on it (see :mod:`swap_core.master_weights`).
Both answer the same questions: which parameters keep one, what the update runs on, which state keys it adds, what a
state must hold, how a batch is updated, how an optimizer's own methods see the parameters.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import torch

from ..adapters.base import StateInit, StateSwapAdapter, UpdateBatch
from ..backends.protocol import DeviceBackend
from ..dtensor import local_tensor
from ..errors import UnsupportedOptimizerError
from ..runtime.slots import SwapSlot
from ..runtime.state_keys import MASTER_KEY, REMAINDER_KEY
from .in_checkpoints import masters_set_aside, unexpected_master
from .outside_step import outside_step_on_masters
from .params import (
    MASTER_DTYPE,
    has_master,
    keeps_remainder,
    master_problem,
    remainder_problem,
    stand_in,
    without_master,
)
from .remainder import remainder_nbytes
from .update import UpdateOnMasters, params_as_masters

__all__ = ["BatchUpdate", "FP32Masters", "Masters", "NoMasters", "RemainderMasters", "masters_policy"]

_LOG = logging.getLogger("swap_core")

_Result = TypeVar("_Result")


class BatchUpdate(Protocol):
    """The update of one batch segment (``adapter.update``, or it over the fp32 masters)."""

    def update(self, batch: UpdateBatch) -> None: ...


class NoMasters:
    """``master_weights=False``: every parameter is updated as it is, and no state key is added."""

    state_keys: tuple[str, ...] = ()

    def keeps(self, param: torch.Tensor) -> bool:
        """Whether ``param`` keeps a master: never."""
        return False

    def keeps_remainder(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s master is kept as its remainder: never."""
        return False

    def as_updated(self, param: torch.Tensor) -> torch.Tensor:
        """What the update runs on, as the adapter is asked about it: the parameter."""
        return param

    def fresh_master(self, param: torch.Tensor) -> dict[str, StateInit]:
        """The master a fresh state of ``param`` starts with: none."""
        return {}

    def check_supported(
        self, optimizer: torch.optim.Optimizer, adapter: StateSwapAdapter, params: list[torch.Tensor]
    ) -> None:
        """Nothing to refuse."""

    def state_problem(
        self, param: torch.Tensor, state: Mapping[str, Any], *, to_make: bool
    ) -> tuple[str | None, Mapping[str, Any]]:
        """No master to check: the state as the adapter checks it."""
        return None, state

    def update(self, adapter: StateSwapAdapter) -> BatchUpdate:
        """The adapter's own update (looked up at each call, so that a test may replace it on the instance)."""
        return adapter

    def set_aside(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None]:
        """The optimizer's state as it is (no master to set aside while an adapter reads it)."""
        return contextlib.nullcontext()

    def params_presented(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None]:
        """The param groups as they are, for an optimizer's own ``load_state_dict``."""
        return contextlib.nullcontext()

    def outside_step(
        self,
        optimizer: torch.optim.Optimizer,
        backend: DeviceBackend,
        slots: Mapping[torch.Tensor, Mapping[str, SwapSlot]],
        call: Callable[[], _Result],
        *,
        method: str,
    ) -> _Result:
        """An optimizer's method outside ``step()`` runs over its own parameters and the states as they are."""
        return call()

    def unexpected_master(self, saved_id: object, param: torch.Tensor) -> str:
        """Why a loaded state with a master cannot load here."""
        return unexpected_master(saved_id, param, master_weights=False)


class FP32Masters:
    """``master_weights=True``: an fp32 master of every bf16/fp16 parameter, swapped with its states, the update run
    on it and the parameter set from it."""

    state_keys: tuple[str, ...] = (MASTER_KEY,)

    def keeps(self, param: torch.Tensor) -> bool:
        """Whether ``param`` keeps a master (a bf16/fp16 parameter)."""
        return has_master(param)

    def keeps_remainder(self, param: torch.Tensor) -> bool:
        """Whether a new master of ``param`` is kept as its remainder: never, an fp32 master."""
        return False

    def as_updated(self, param: torch.Tensor) -> torch.Tensor:
        """What the update runs on, as the adapter is asked about it: an fp32 stand-in of a master's parameter."""
        return stand_in(param) if has_master(param) else param

    def fresh_master(self, param: torch.Tensor) -> dict[str, StateInit]:
        """The master a fresh state of ``param`` starts with (filled from the parameter, exactly: fp32 holds every
        bf16/fp16 value), where it keeps one."""
        return {MASTER_KEY: StateInit(tuple(param.shape), MASTER_DTYPE)} if has_master(param) else {}

    def check_supported(
        self, optimizer: torch.optim.Optimizer, adapter: StateSwapAdapter, params: list[torch.Tensor]
    ) -> None:
        """Refuse, before anything changes, a family that cannot run on masters (only where some parameter gets one;
        with none, fp32 parameters only, there is nothing to refuse)."""
        if not any(has_master(param) for param in params):
            _LOG.info("master_weights=True, but no parameter is bfloat16 or float16: no master copy is made")
            return
        reason = adapter.master_weights_unsupported
        if reason is not None:
            raise UnsupportedOptimizerError(
                f"master_weights=True is not supported yet for {type(optimizer).__name__} through "
                f"{type(adapter).__name__}: {reason}. Adam, AdamW, RMSprop, Muon and the optimizers swap-generic runs "
                "support it (FSDP2 and HSDP included), or keep master_weights=False"
            )

    def state_problem(
        self, param: torch.Tensor, state: Mapping[str, Any], *, to_make: bool
    ) -> tuple[str | None, Mapping[str, Any]]:
        """Why ``param``'s state lacks a usable master (``to_make``: a missing one is to be made from the parameter),
        and the state without its master, as the adapter checks it."""
        if not has_master(param):
            return None, state
        problem = None if to_make and MASTER_KEY not in state else master_problem(param, state)
        return problem, without_master(state)

    def update(self, adapter: StateSwapAdapter) -> BatchUpdate:
        """The adapter's update over the fp32 masters of each batch's bf16/fp16 parameters."""
        return UpdateOnMasters(adapter)

    def set_aside(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None]:
        """The optimizer's state without the masters (swap's, not the optimizer's) while an adapter reads it."""
        return masters_set_aside(optimizer)

    def params_presented(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None]:
        """The param groups listing fp32 stand-ins of the low-precision parameters, for an optimizer's own
        ``load_state_dict`` (its casts keep the states in fp32)."""
        return params_as_masters(optimizer)

    def outside_step(
        self,
        optimizer: torch.optim.Optimizer,
        backend: DeviceBackend,
        slots: Mapping[torch.Tensor, Mapping[str, SwapSlot]],
        call: Callable[[], _Result],
        *,
        method: str,
    ) -> _Result:
        """An optimizer's method outside ``step()`` runs over the fp32 masters, one parameter at a time."""
        return outside_step_on_masters(optimizer, backend, slots, call, method=method)

    def unexpected_master(self, saved_id: object, param: torch.Tensor) -> str:
        """Why a loaded state with a master cannot load into a parameter that keeps none."""
        return unexpected_master(saved_id, param, master_weights=True)


class RemainderMasters(FP32Masters):
    """``master_weights=True`` where the update runs in ``step()`` only: a bf16 parameter keeps its master as the bits
    it lacks (``"master_remainder"``, 2.125 bytes a parameter instead of 4, a DTensor's of its local shard, swapped
    with the states); the update rebuilds the master on the device, runs on it, sets the parameter and splits the
    master back. Other parameters keep an fp32 master (fp16 ones, channels-last ones). A state holding either form
    is used as it is."""

    state_keys: tuple[str, ...] = (MASTER_KEY, REMAINDER_KEY)

    def keeps_remainder(self, param: torch.Tensor) -> bool:
        """Whether a new master of ``param`` (made fresh, from a parameter or loaded) is kept as its remainder."""
        return keeps_remainder(param)

    def fresh_master(self, param: torch.Tensor) -> dict[str, StateInit]:
        """A bf16 parameter's fresh master in remainder form: all zeros (the parameter is its master, exactly)."""
        if not keeps_remainder(param):
            return super().fresh_master(param)
        nbytes = remainder_nbytes(local_tensor(param).numel())  # of this rank's shard: held whole, not sharded
        return {REMAINDER_KEY: StateInit((nbytes,), torch.uint8, shard_like_param=False)}

    def state_problem(
        self, param: torch.Tensor, state: Mapping[str, Any], *, to_make: bool
    ) -> tuple[str | None, Mapping[str, Any]]:
        """As :meth:`FP32Masters.state_problem`, the master in the form the state holds it."""
        if not has_master(param) or REMAINDER_KEY not in state:
            return super().state_problem(param, state, to_make=to_make)
        return remainder_problem(param, state), without_master(state)


Masters = NoMasters | FP32Masters


def masters_policy(master_weights: bool, *, in_step_only: bool = False) -> Masters:
    """The master-weights policy ``SwapConfig.master_weights`` asks for; ``in_step_only``: every update runs in
    ``step()`` over the states the step swaps in (no update taken back after it wrote its parameters, no method
    of the optimizer run outside ``step()``), where a master may be kept as its remainder."""
    if not master_weights:
        return NoMasters()
    return RemainderMasters() if in_step_only else FP32Masters()
