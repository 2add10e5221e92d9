"""``AppState``: a model and its (swapped) optimizers as one DCP ``Stateful``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from .flat_state import is_flat_optimizer_state, nest_flat_optimizer_state
from .host_snapshot import host_snapshot
from .init_guard import check_uniform_state_init, initialize_swapped_states

__all__ = ["AppState"]

MODEL_KEY = "model"
OPTIM_KEY = "optim"


class AppState(Stateful):
    """A model and one or several optimizers (swapped or plain), FQN-keyed, for ``dcp.save`` / ``dcp.load``.

    ::

        dcp.save({"app": AppState(model, [muon, adamw])}, checkpoint_id=path)
        dcp.load({"app": AppState(model, [muon, adamw])}, checkpoint_id=path)

    The state-dict story: :meth:`state_dict` is torch's
    ``get_state_dict(model, optimizers)``, FQN-keyed, nested or flattened as
    ``options`` say. A swapped optimizer without state gets it from
    ``SwapOptimizer.initialize_state`` first (host-born, no step, no device
    traffic; see :func:`~swap_ckpt.init_guard.initialize_swapped_states`), so
    torch's zero-gradient initializing step only ever runs for plain
    optimizers. Each optimizer's ``state_dict()`` is its checkpoint layout
    (distributed Muon's owners scatter their momentum into fresh per-shard
    DTensors, a collective). Its optimizer tensors are private: host copies of
    whatever shares storage with live state, such as the swapped host mirrors
    (:mod:`swap_ckpt.host_snapshot`); tensors already fresh are not copied again. An async save
    reads the state as it was at the call, whatever steps follow, and a load
    writes into the copies, never into live state. :meth:`load_state_dict`
    hands them to ``set_state_dict`` (a flattened dict nested by its own keys
    first, :mod:`swap_ckpt.flat_state`), whose ``optimizer.load_state_dict``
    checks everything and stages swapped states straight into host memory, or
    raises with the live state untouched. Model parameters load in place, as
    with torch's own helpers.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        *,
        options: StateDictOptions | None = None,
    ) -> None:
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        optimizers = list(optimizers)
        for index, optimizer in enumerate(optimizers):
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizers[{index}] must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not optimizers:
            raise ValueError(
                "AppState needs at least one optimizer; checkpoint a model alone with get_model_state_dict"
            )
        self.model = model
        self.optimizers = optimizers
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}`` FQN-keyed; optimizer tensors are host copies of the current state."""
        initialize_swapped_states(self.optimizers)
        check_uniform_state_init(self.optimizers)
        model_state, optim_state = get_state_dict(self.model, self.optimizers, options=self.options)
        return {MODEL_KEY: model_state, OPTIM_KEY: host_snapshot(dict(optim_state), self.optimizers)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict of :meth:`state_dict`'s form (as ``dcp.load`` fills it) into the model and optimizers."""
        missing = [key for key in (MODEL_KEY, OPTIM_KEY) if key not in state_dict]
        if missing:
            raise KeyError(f"AppState.load_state_dict needs keys {[MODEL_KEY, OPTIM_KEY]}; missing {missing}")
        initialize_swapped_states(self.optimizers)
        check_uniform_state_init(self.optimizers)
        optim_state = state_dict[OPTIM_KEY]
        if is_flat_optimizer_state(optim_state):
            optim_state = nest_flat_optimizer_state(optim_state, self.optimizers)
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state_dict[MODEL_KEY],
            optim_state_dict=optim_state,
            options=self.options,
        )
