"""fp32 master weights of bf16/fp16 parameters, kept as optimizer state and swapped with the others.

With ``SwapConfig(master_weights=True)`` every parameter in a low-precision floating dtype
(:data:`LOW_PRECISION_DTYPES`) gets an fp32 copy under the state key :data:`MASTER_KEY`. The
family's update runs on that copy, as if it were the parameter, with the gradient upcast to fp32
and fp32 states; the parameter is then set from it (``param.copy_(master)``, round to nearest
even). The reference, which the tests hold every family to bitwise, is the plain optimizer built
over fp32 leaf copies ``m = p.detach().float()``, each step ``m.grad = p.grad.float()``,
``step()``, then ``p.copy_(m)``.

The mechanism lives here once (the runtime calls it); adapters never see a low-precision parameter
in master mode, only its master, so none of them re-implements it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .adapters.base import StateSwapAdapter, UpdateBatch
from .errors import SwapStateError
from .runtime.group_values import GroupValues
from .runtime.narrowed_groups import NarrowedGroups
from .runtime.state_keys import MASTER_KEY, is_fresh
from .runtime.tracked_state import TrackedState

if TYPE_CHECKING:
    from .backends.protocol import DeviceBackend

_Result = TypeVar("_Result")

__all__ = [
    "LOW_PRECISION_DTYPES",
    "MASTER_KEY",
    "MasterPair",
    "OnMasters",
    "has_master",
    "is_fresh",
    "master_problem",
    "master_state_dict",
    "masters_presented",
    "model_param",
    "on_masters",
    "outside_step_on_masters",
    "params_as_masters",
    "stand_in",
    "update_on_masters",
    "without_master",
]


LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)
"""Parameter dtypes that get a master copy; every other parameter is updated as it is."""

MASTER_DTYPE = torch.float32

_STOOD_FOR = WeakIdKeyDictionary()
"""Each live stand-in's parameter (by the stand-in's identity; an entry goes with its stand-in)."""

MasterPair = tuple[torch.Tensor, torch.Tensor]
"""``(parameter, its master's device copy)`` of one updated parameter."""


def has_master(param: torch.Tensor) -> bool:
    """Whether ``param`` gets an fp32 master copy in master-weights mode."""
    return param.dtype in LOW_PRECISION_DTYPES


def stand_in(param: torch.Tensor) -> torch.Tensor:
    """An fp32 tensor with ``param``'s shape and device that holds one element (expanded).

    What an adapter's ``initial_state`` and ``state_mismatch`` are asked about in place of a
    low-precision parameter: the update runs on the master, so fresh states take its dtype, while
    only shape, dtype and device are read. Four bytes, whatever the parameter's size. An adapter
    that knows parameters by identity finds ``param`` again with :func:`model_param`.
    """
    fp32 = torch.empty((), dtype=MASTER_DTYPE, device=param.device).expand(param.shape)
    _STOOD_FOR[fp32] = param
    return fp32


def model_param(tensor: torch.Tensor) -> torch.Tensor:
    """The parameter ``tensor`` stands in for, if it is a :func:`stand_in`; else ``tensor`` itself."""
    param: torch.Tensor | None = _STOOD_FOR.get(tensor)  # type: ignore[no-untyped-call]
    return tensor if param is None else param


def without_master(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` without its master copy: what the family's own update reads."""
    return {key: value for key, value in state.items() if key != MASTER_KEY}


def master_problem(param: torch.Tensor, state: Mapping[str, Any]) -> str | None:
    """Why the non-empty ``state`` of a low-precision ``param`` cannot be used in master-weights mode, or ``None``.

    The master must be there, fp32 and shaped like the parameter, and every other floating state
    fp32 (the update runs on the master: torch's own load, for one, casts states to the parameter's
    dtype, which would silently lose the precision master weights exist for).
    """
    master = state.get(MASTER_KEY)
    if not isinstance(master, torch.Tensor):
        return f"has no {MASTER_KEY!r} (its fp32 master copy; it has {_keys(state)}){_LOAD_HINT}"
    if master.dtype != MASTER_DTYPE or tuple(master.shape) != tuple(param.shape):
        return (
            f"has {MASTER_KEY!r} of {master.dtype} and shape {tuple(master.shape)}, but the master of this "
            f"{param.dtype} parameter is {MASTER_DTYPE} of shape {tuple(param.shape)}{_LOAD_HINT}"
        )
    for key, value in state.items():
        if key == "step" or not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() == 0:
            continue
        if value.dtype != MASTER_DTYPE:
            return (
                f"has {key!r} in {value.dtype}, but with master weights every floating state is "
                f"{MASTER_DTYPE}{_LOAD_HINT}"
            )
    return None


_LOAD_HINT = (
    " (load checkpoints through the SwapOptimizer, which keeps them in fp32 and makes missing masters from the "
    "parameters: torch's own load_state_dict casts every state to the parameter's dtype)"
)


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

    def write_back(self) -> None:
        """What the update wrote to the state copies, into the state dicts (keys set, replaced or removed)."""
        for state, copied in self._copies:
            for key, value in copied.items():
                if state.get(key) is not value:
                    state[key] = value
            for key in [key for key in state if key != MASTER_KEY and key not in copied]:
                del state[key]

    def set_params(self) -> None:
        """``param.copy_(master)`` for each pair: the parameter rounds its updated master to nearest even."""
        with torch.no_grad():
            for param, master in self.pairs:
                param.copy_(master)


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
    for param, grad, state in zip(params, grads, states, strict=True):
        if not has_master(param):
            update_params.append(param)
            update_grads.append(grad)
            update_states.append(state)
            continue
        master = state.get(MASTER_KEY)
        if not isinstance(master, torch.Tensor):  # never update the low-precision parameter itself instead
            raise SwapStateError(
                f"The {param.dtype} parameter of shape {tuple(param.shape)} has no {MASTER_KEY!r} in its state "
                f"(it has {_keys(state)}): master weights cannot update it (the step checks every state before any "
                "batch; was the state edited during the step?)"
            )
        copied = without_master(state)
        update_params.append(master)
        update_grads.append(grad.to(MASTER_DTYPE))
        update_states.append(copied)
        pairs.append((param, master))
        copies.append((state, copied))
    return OnMasters(update_params, update_grads, update_states, list(params), pairs, copies)


def update_on_masters(adapter: StateSwapAdapter) -> Callable[[UpdateBatch], None]:
    """``adapter``'s update run on the fp32 masters of each batch's bf16/fp16 parameters, which then follow their
    masters (see :func:`on_masters`); the adapter's ``update`` is looked up at each call."""

    def update(batch: UpdateBatch) -> None:
        masters = on_masters(batch.params, batch.grads, batch.states)
        try:
            adapter.update(
                UpdateBatch(batch.group, masters.params, masters.grads, masters.states, batch.batch_index, batch.params)
            )
        finally:
            masters.write_back()
        masters.set_params()

    return update


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


def master_state_dict(module: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> dict[str, Any]:
    """``module.state_dict()`` with each parameter that has a master replaced by a copy of that fp32 master.

    For a final full-precision export of a model trained with ``master_weights=True``: keys and
    everything else (fp32 parameters, buffers) are ``module.state_dict()``'s; a master is looked up
    in the state of whichever of ``optimizers`` holds the parameter, under every name of a tied
    parameter. A bf16/fp16 parameter without a master (it never had a gradient) is exported as fp32
    too, its own values, so that every parameter of the export is fp32. Each optimizer is synchronized
    first (a swapped master is read from its host mirror); the values are new CPU tensors.
    """
    masters: dict[int, torch.Tensor] = {}
    for optimizer in optimizers:
        synchronize = getattr(optimizer, "synchronize", None)
        if callable(synchronize):
            synchronize()
        for param, state in optimizer.state.items():
            master = state.get(MASTER_KEY)
            if isinstance(master, torch.Tensor):
                masters[id(param)] = master
    exported = dict(module.state_dict())
    for name, param in module.named_parameters(remove_duplicate=False):  # every name of a tied parameter
        if name not in exported:
            continue
        master = masters.get(id(param))
        if master is not None:
            exported[name] = master.detach().to("cpu", copy=True)
        elif has_master(param):  # never stepped: its master would be itself; fp32 like the others
            exported[name] = param.detach().to("cpu", dtype=MASTER_DTYPE, copy=True)
    return exported


def _keys(state: Mapping[str, Any]) -> str:
    return ", ".join(repr(key) for key in state) or "no keys"


def outside_step_on_masters(
    optimizer: torch.optim.Optimizer, backend: DeviceBackend, call: Callable[[], _Result], *, method: str = "method"
) -> _Result:
    """Run ``call`` (a method of ``optimizer`` that reads and writes parameters and states outside ``step()``) as the
    plain optimizer over fp32 masters would run it, one parameter at a time.

    For each parameter in turn, its swapped states and master are copied to the device, the param groups list only
    the master (the parameter itself when it has none) with those device states as its ``state`` entry, and
    ``call`` runs; the states and the master are then copied back to their host mirrors and the parameter is set
    from the master. Group values (``train_mode``...) are restored before each parameter's call, and every call
    must leave the same ones, which are kept (``method``, its name, names it otherwise); a call that changes the
    param groups is refused. Device memory: one parameter's states at a time. The caller has
    synchronized the optimizer and dropped any prefetch; host mirrors are current again when this returns.
    """
    values = GroupValues(optimizer, method=method, share="parameter", refusal=_not_one_parameter_at_a_time)
    narrowed = NarrowedGroups(optimizer, method=method)
    results: list[_Result] = []
    try:
        for group in list(optimizer.param_groups):
            for param in list(group["params"]):
                values.before_batch()
                with _staged(optimizer, backend, param) as presented, backend.compute_scope():
                    results.append(narrowed.run(call, group, [presented]))
                    if presented is not param:
                        with torch.no_grad():
                            param.copy_(presented)
                values.after_batch(len(results) - 1)
    except BaseException:
        # The groups as the calls that finished left them (as before any, where none did).
        if results:
            values.put_back_first_writes()
        else:
            values.put_back_start()
        raise
    finally:
        backend.synchronize()
    if not results:  # no parameter at all: once over the (empty) groups, as the plain optimizer would
        return call()
    return results[-1]


def _not_one_parameter_at_a_time(sentence: str) -> Exception:
    return SwapStateError(f"{sentence}: it cannot run one parameter at a time over fp32 masters")


@contextlib.contextmanager
def _staged(optimizer: torch.optim.Optimizer, backend: DeviceBackend, param: torch.Tensor) -> Iterator[torch.Tensor]:
    """``param``'s master (or ``param``) with device copies of its host-mirrored states as its ``state`` entry."""
    entries = optimizer.state
    if not isinstance(entries, TrackedState):
        raise TypeError(f"outside_step_on_masters needs a SwapOptimizer's state, got a {type(entries).__name__}")
    state = dict.get(entries, param) or {}
    compute = backend.compute_stream()
    staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and not backend.owns(value):
            device = backend.empty(tuple(value.shape), value.dtype)
            backend.copy(device, value, stream=compute)
            staged[key] = (value, device)
    presented_state = {key: staged[key][1] if key in staged else value for key, value in state.items()}
    master = presented_state.pop(MASTER_KEY, None)
    presented = master if isinstance(master, torch.Tensor) else param
    try:
        with entries.lent([(presented, presented_state)] if state else []):
            yield presented
        for host, device in staged.values():
            backend.copy(host, device, stream=compute)
    finally:
        for _, device in staged.values():
            backend.release_storage(device)
