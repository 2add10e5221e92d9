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
from .host_snapshot import private_destinations, private_host_bytes
from .init_guard import check_uniform_state_init, initialize_swapped_states
from .stager_compat import offset_free
from .torch_compat import tree_map_only

__all__ = ["AppState"]

MODEL_KEY = "model"
OPTIM_KEY = "optim"


class AppState(Stateful):
    """A model and one or several optimizers (swapped or plain), FQN-keyed, for ``dcp.save`` / ``dcp.load``.

    ::

        dcp.save({"app": AppState(model, [muon, adamw])}, checkpoint_id=path)
        load_checkpoint({"app": AppState(model, [muon, adamw])}, path)

    The state-dict story: :meth:`state_dict` is torch's
    ``get_state_dict(model, optimizers)``, FQN-keyed, nested or flattened as
    ``options`` say. A swapped optimizer without state gets it from
    ``SwapOptimizer.initialize_state`` first (host-born, no step, no device
    traffic; see :func:`~swap_ckpt.init_guard.initialize_swapped_states`), so
    torch's zero-gradient initializing step only ever runs for plain
    optimizers. Each optimizer's ``state_dict()`` is its checkpoint layout:
    a swapped optimizer's host mirrors themselves, which a save reads in place
    (no copy: ``dcp.save`` finishes before the next step, and ``dcp.async_save``
    stages its own copy before it returns; DTensor mirrors are handed over as
    :func:`~swap_ckpt.stager_compat.offset_free` aliases, which DCP's stager can
    copy); distributed Muon's owners scatter
    their momentum into fresh per-shard DTensors, a collective.

    Loading: ``dcp.load`` writes into the tensors :meth:`state_dict` returned,
    so it streams the checkpoint straight into the live host mirrors, as it
    does into a plain torch optimizer's state. :func:`~swap_ckpt.load_checkpoint`
    checks the checkpoint first and reads it into :meth:`load_target`'s private
    host tensors (or, with ``in_place=True``, into the mirrors). :meth:`load_state_dict`
    hands the result to ``set_state_dict`` (a flattened dict nested by its own keys
    first, :mod:`swap_ckpt.flat_state`), whose ``optimizer.load_state_dict``
    checks everything and copies swapped states into the live host mirrors, or
    raises with the live state untouched. Model parameters load in place, as
    with torch's own helpers.

    :attr:`private_host_bytes` is the host memory the last :meth:`state_dict` or
    :meth:`load_target` added for the checkpoint on this rank: tensors that are not the
    optimizers' live state (0 for a save of swapped AdamW; the exported shards of
    distributed Muon; every optimizer tensor for a private load target).
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
        self.private_host_bytes = 0
        """Host bytes of the last state dict's optimizer tensors that are not live state (see the class)."""

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}`` FQN-keyed; a swapped optimizer's tensors are its live host mirrors."""
        initialize_swapped_states(self.optimizers)
        check_uniform_state_init(self.optimizers)
        model_state, optim_state = get_state_dict(self.model, self.optimizers, options=self.options)
        optim: dict[str, Any] = tree_map_only(torch.Tensor, offset_free, dict(optim_state))
        self.private_host_bytes = private_host_bytes(optim, self.optimizers)
        return {MODEL_KEY: model_state, OPTIM_KEY: optim}

    def load_target(self, *, in_place: bool = False) -> dict[str, Any]:
        """What a load reads into: :meth:`state_dict`, live optimizer tensors replaced by fresh host tensors.

        The private tensors take the whole optimizer state of this rank (:attr:`private_host_bytes`)
        until :meth:`load_state_dict` has copied them into the live state; then they are freed. With
        ``in_place=True`` it is :meth:`state_dict` itself: the load writes into the live state (no
        extra host memory; a read that fails mid-way leaves it partly overwritten, so load again).
        """
        target = self.state_dict()
        if not in_place:
            target[OPTIM_KEY] = private_destinations(target[OPTIM_KEY], self.optimizers)
            self.private_host_bytes = private_host_bytes(target[OPTIM_KEY], self.optimizers)
        return target

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
