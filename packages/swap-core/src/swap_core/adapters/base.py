"""The adapter contract: what an optimizer family tells the swap runtime.

An adapter is policy: which state keys may move, how a fresh state looks, and
how one batch of parameters is updated with states that already sit on the
device. The runtime (mechanism) decides where every state lives and when it
moves; the adapter never sees a host tensor or a stream.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from ..errors import UnsupportedOptimizerError
from .overrides import check_no_bypassed_overrides

__all__ = [
    "ADAPTER_API_VERSION",
    "RESIDENT_BATCH_INDEX",
    "AdapterFactory",
    "StateInit",
    "StateSwapAdapter",
    "UpdateBatch",
    "compare_state",
    "refuse_differentiable",
]

ADAPTER_API_VERSION = 1
"""Bumped whenever :class:`StateSwapAdapter` changes incompatibly."""


@dataclasses.dataclass(frozen=True)
class StateInit:
    """A state tensor to create filled with ``fill``, materialized where the runtime keeps it.

    Returning this instead of a tensor lets a swapped state be born in host
    memory, so the first step needs no more device memory than later ones.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: float = 0.0
    shard_like_param: bool = True
    """For a DTensor parameter: the state is sharded like it (only the local shard is held). ``False``: a
    plain tensor of ``shape`` held whole by this rank (e.g. distributed Muon's owner-side momentum)."""

    @classmethod
    def zeros_like(cls, tensor: torch.Tensor) -> StateInit:
        """Zeros with the shape and dtype of ``tensor`` (the usual optimizer moment)."""
        return cls(tuple(tensor.shape), tensor.dtype, 0.0)


RESIDENT_BATCH_INDEX = -1
"""``UpdateBatch.batch_index`` of the update of a plan's resident batch (parameters without a swapped state), which
runs before batch 0."""


@dataclasses.dataclass
class UpdateBatch:
    """The parameters of one param group inside one pipeline batch.

    ``states[i]`` is the state dict of ``params[i]`` in which every swapped
    tensor has been replaced by its device copy for the duration of the update.
    Only parameters with a gradient are included, in param-group order.
    """

    group: dict[str, Any]
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    states: list[dict[str, Any]]
    batch_index: int
    model_params: list[torch.Tensor] | None = None
    """With ``SwapConfig(master_weights=True)``: the parameters the model holds. ``params[i]`` is then the
    fp32 master of ``model_params[i]`` (or that parameter itself, if it keeps no master), ``grads[i]`` its
    gradient in fp32 and ``states[i]`` its state without the master; ``None`` otherwise. An adapter that
    runs the optimizer's own ``step`` presents the masters to it with
    :func:`~swap_core.master_weights.masters_presented`."""


class StateSwapAdapter(abc.ABC):
    """Family policy for one wrapped optimizer instance."""

    swappable_keys: ClassVar[tuple[str, ...] | None] = ()
    """State keys this family can swap (e.g. ``("exp_avg", "exp_avg_sq")``); ``None``: any key whose value
    is a large enough dense tensor on the device (an adapter that runs an optimizer it does not know)."""

    created_keys: frozenset[str] | None = None
    """With :attr:`swappable_keys` ``None``: the state keys the adapter saw its optimizer create (a probe at wrap
    time), against which ``SwapConfig(state_keys=...)`` is checked; ``None``: not known (nothing is checked)."""

    lazy_states: ClassVar[bool] = False
    """Whether :meth:`update` creates missing states itself, on the device, as torch's own ``step`` does.

    An adapter that runs the wrapped optimizer's own ``step`` cannot say what a fresh state looks like
    before that step made it. The runtime then never calls :meth:`initial_state`: a parameter without
    state is updated with an empty state dict, and right after its batch the states the update created
    move to host memory, so no more than one batch of fresh states is on the device at once."""

    swaps_nested_states: ClassVar[bool] = False
    """Whether the states the optimizer keeps in a dict nested one level deep in a parameter's state
    (``state[p]["moments"]["exp_avg"]``) are swapped too, each named by its path (``"moments.exp_avg"``) and kept in
    its place in the nested dict (:mod:`swap_core.runtime.nested_entries`); else such a dict stays where it is."""

    outside_step_methods: tuple[str, ...] = ()
    """Methods of the wrapped optimizer that read and write its parameters and states outside ``step()``
    (schedule-free's ``train`` and ``eval``). The :class:`~swap_core.SwapOptimizer` offers each one
    (``swapped.eval()``; the wrapped optimizer's own attribute is redirected to it) and runs it on current
    states, over the fp32 masters with master weights (:func:`~swap_core.master_weights.outside_step_on_masters`).
    An instance attribute: an adapter sets it for the optimizers that have such methods."""

    master_weights_unsupported: str | None = None
    """Why :meth:`update` cannot run on fp32 master weights yet, or ``None`` when it can (a class attribute,
    or set by ``__init__`` for the wrapped optimizer it was given). With
    ``SwapConfig(master_weights=True)`` the runtime hands the update each bf16/fp16 parameter's fp32 master
    (a tensor of the parameter's shape and sharding) in its place (see :attr:`UpdateBatch.model_params`);
    an adapter that names a reason here is refused in that mode, with the reason, before anything changes."""

    needs_parameter_order: str | None = None
    """Why the updates must run in torch's parameter order (an update that draws random numbers: each draw lands on
    the parameter torch's step gives it only in that order), or ``None`` when any order gives the same numbers (a
    class attribute, or set by ``__init__`` for the wrapped optimizer it was given). Where it names a reason, the
    batches are walked first to last with the parameters whose states stay on the device in their place (no
    resident batch first), and the modes whose walk cannot follow that order (``prefetch="backward"``,
    ``step="in_backward"``: the last parameters first) are refused at wrap time, naming the reason."""

    reproduces: ClassVar[tuple[type[torch.optim.Optimizer], ...]] = ()
    """torch classes whose update :meth:`update` reproduces with torch's functional kernel. An optimizer
    whose class overrides one of :attr:`reproduced_methods` of them would be silently bypassed: the
    constructor refuses it (:func:`~swap_core.adapters.overrides.check_no_bypassed_overrides`). Leave
    empty for an adapter that runs the optimizer's own ``step``."""

    reproduced_methods: ClassVar[tuple[str, ...]] = ("step", "_init_group")
    """The methods of :attr:`reproduces` the adapter stands in for."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if self.reproduces:
            check_no_bypassed_overrides(optimizer, self.reproduces, self.reproduced_methods, type(self).__name__)
        self.optimizer = optimizer

    @abc.abstractmethod
    def initial_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor | StateInit]:
        """The state a fresh parameter starts with, exactly as the wrapped optimizer would create it.

        With master weights, ``param`` of a bf16/fp16 parameter is an fp32 stand-in of its shape (the
        update runs on its fp32 master); :func:`~swap_core.master_weights.model_param` gives the parameter.
        """

    @abc.abstractmethod
    def update(self, batch: UpdateBatch) -> None:
        """Update ``batch.params`` in place with the wrapped optimizer's own math."""

    def expected_states(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, StateInit]:
        """For an adapter whose update creates the states (:attr:`lazy_states`): the states the first update of
        ``param`` will create, as far as the adapter knows them (an empty dict: nothing known). The runtime checks
        with them that host memory can take a first step's states before any batch updates anything."""
        return {}

    def step_scope(self) -> contextlib.AbstractContextManager[None]:
        """Entered around every batch update of one ``step()`` (after the step hooks and the closure ran).

        For what must hold across the batches of a step, e.g. param group values every batch starts
        from. Default: nothing.
        """
        return contextlib.nullcontext()

    def entries_written_beside(self, group: dict[str, Any], params: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """The parameters, other than ``params``, whose entries of ``state`` the :meth:`update` of ``params`` (a share
        of ``group``, about to run) writes too; the runtime keeps their resident values with the batch's, so that a
        failed step's journal and a take-back of a step begun inside the backward put them back. swap-generic names
        the group's first parameter where it keeps a group's step counter there. ``params`` are the model's
        parameters (not masters). Default: none."""
        return ()

    def state_mismatch(self, param: torch.Tensor, group: Mapping[str, Any], state: Mapping[str, Any]) -> str | None:
        """Why the non-empty ``state`` of ``param`` is not what this family's update reads, or ``None``.

        The runtime asks before any batch of a step updates anything (after a load, or after the state
        was edited by hand), so a step never fails part-way on a missing key. The default compares with
        :meth:`initial_state`: every key it creates must be there and no other, and a state it creates
        as a :class:`StateInit` must have that shape. An empty state is never asked about (the step
        creates it afresh, as torch does).
        An adapter with :attr:`lazy_states` knows no fresh state: the default accepts any state then.

        With master weights, ``state`` is the state without its master and ``param`` what the update
        runs on: an fp32 stand-in of the parameter's shape (:func:`~swap_core.master_weights.stand_in`,
        as for :meth:`initial_state`); :func:`~swap_core.master_weights.model_param` gives the parameter.
        """
        if self.lazy_states:
            return None
        expected = self.initial_state(param, dict(group))
        return compare_state(
            state,
            {key: template.shape if isinstance(template, StateInit) else None for key, template in expected.items()},
            unknown="which this family does not create",
            wrong_shape="the parameter needs",
        )

    def params_changed(self, params: Sequence[torch.Tensor]) -> None:
        """The optimizer's parameters (or their order) changed; ``params`` is the new order. Raise to refuse.

        Called when param groups were edited by hand, through the wrapped optimizer or
        ``add_param_group``, and by ``reset_optimizer_parameters``. Default: nothing to do.
        """
        return None

    def partition_costs(self, params: Sequence[torch.Tensor]) -> Sequence[int] | None:
        """Rank-independent cost per parameter for batching, or ``None`` to balance by swapped bytes.

        Return costs (in bytes) when ranks hold different states but run collectives per batch: every
        rank then walks exactly the same batches, even a rank that swaps nothing.
        """
        return None

    def agree_on_batches(self, batches: int) -> int:
        """With rank-independent :meth:`partition_costs` and ``swap_times="auto"``: the batch count every rank
        takes, from this rank's own choice (each rank's fits its free device memory, which can differ); a
        collective, called by every rank at the same re-plan. Default (one rank, or costs per rank): ``batches``.
        The largest count any rank needs fits every rank (staging only shrinks with more batches).
        """
        return batches

    # -- checkpoint glue ----------------------------------------------------------
    def export_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint form of ``state_dict``, the wrapped optimizer's own format built from the live state.

        ``SwapOptimizer.state_dict()`` returns this. Override it when the live state has another layout
        than the plain optimizer's (distributed Muon keeps whole matrices on owner ranks; a checkpoint
        holds every rank's shard). Runs on every rank alike, so it may run collectives. Swapped tensors
        in ``state_dict`` are the host mirrors: return new tensors, never modify them. Default: unchanged.
        Not applied when nothing is swapped (CPU parameters, ``backend="auto"``): the wrapped optimizer's own step
        then keeps its state, in its own layout.
        """
        return state_dict

    def import_state_dict(self, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
        """The inverse of :meth:`export_state_dict`, applied first by ``SwapOptimizer.load_state_dict``.

        ``state`` may be keyed by the ids of ``state_dict()`` or by FQNs (torch.distributed.checkpoint);
        ``swap_core.state_dict_loading.saved_param_ids`` pairs them with the live parameters. Must not
        modify the live state (loading checks everything before committing). Default: unchanged. Not applied when
        nothing is swapped, as :meth:`export_state_dict`.
        """
        return state_dict


def compare_state(
    state: Mapping[str, Any], expected: Mapping[str, tuple[int, ...] | None], *, unknown: str, wrong_shape: str
) -> str | None:
    """Why ``state`` is not a state with exactly the keys of ``expected`` and, where it gives one, that shape; or
    ``None``. The sentence continues "The state of parameter i ...": ``unknown`` says why a key not expected is
    wrong ("which this family does not create"), ``wrong_shape`` leads to the expected shape ("the parameter
    needs")."""
    missing = [key for key in expected if key not in state]
    if missing:
        return f"lacks {_keys(missing)}, which the update reads (it has {_keys(list(state))})"
    extra = [key for key in state if key not in expected]
    if extra:
        return f"has {_keys(extra)}, {unknown} (its keys are {_keys(list(expected))})"
    for key, shape in expected.items():
        value = state[key]
        if shape is not None and isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
            return f"has {key!r} of shape {tuple(value.shape)}, but {wrong_shape} {shape}"
    return None


def _keys(keys: Sequence[object]) -> str:
    return ", ".join(repr(key) for key in keys) or "no keys"


AdapterFactory = Callable[[torch.optim.Optimizer], StateSwapAdapter]


def refuse_differentiable(optimizer_name: str, group: Mapping[str, Any], index: int | None) -> None:
    """Refuse a param group with ``differentiable=True``, naming it: every family does, before anything changes.

    Autograd through the update needs the states in the graph from one step to the next; a swapped state is copied
    to host memory and back between steps, which cuts the graph (torch's own gradcheck of such an update would
    differ, or fail part-way through a step).
    """
    if group.get("differentiable", False):
        where = f"param group {index}" if index is not None else "a param group"
        raise UnsupportedOptimizerError(
            f"{optimizer_name} with differentiable=True in {where} cannot be swapped: its state is copied between "
            "host and device memory, which breaks the autograd graph differentiable=True needs; create the "
            "optimizer with differentiable=False (or keep it unswapped)"
        )
