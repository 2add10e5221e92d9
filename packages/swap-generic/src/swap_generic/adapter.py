"""The generic adapter: any per-parameter optimizer, updated batch by batch by its own ``step``.

For each pipeline batch, every param group's ``"params"`` list is replaced by the batch's share of it
(an empty list for a group with no parameter in the batch) and the optimizer's own ``step`` runs,
below torch's hook wrapper; the original list objects are put back afterwards, whatever happens.
The batch's swapped states sit in ``optimizer.state`` as device copies meanwhile, so the step reads
and writes them where it would in an unswapped run: the numbers are the plain optimizer's, bitwise,
whichever optimizer it is. States the step creates (its first step) are born on the device, one
batch at a time, and move to host memory right after their batch.

The contract: an optimizer whose step updates each parameter from its own gradient and state only.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from swap_core.adapters import GroupValues, NarrowedGroups
from swap_core.adapters.base import StateInit, StateSwapAdapter, UpdateBatch, compare_state, refuse_differentiable
from swap_core.adapters.registry import AdapterRegistry
from swap_core.errors import UnsupportedOptimizerError
from swap_core.master_weights import masters_presented, model_param
from swap_core.torch_compat import step_hooks_silenced

from .first_parameter_values import FirstParameterValues
from .group_recheck import group_switch, snapshot
from .nested_states import flat_state, is_nest, nest_problem
from .probe import ProbeVerdict, probe_step
from .third_party import outside_step_methods, third_party_refusal
from .torch_compat import unhooked_step

__all__ = ["DECLARATION", "NOT_PER_PARAMETER", "GenericAdapter", "register"]

DECLARATION = "swap_per_parameter"
"""An optimizer class (or instance) attribute that settles what the wrap-time probe would decide: ``True``, its step
is per-parameter (accepted even where the probe cannot tell, or tells otherwise); ``False``, it is not (refused)."""

NOT_PER_PARAMETER: Mapping[str, str] = {
    "torch.optim.lbfgs.LBFGS": (
        "it evaluates a closure over all parameters several times per step and keeps its own flat view of them"
    ),
    "torch.distributed.optim.zero_redundancy_optimizer.ZeroRedundancyOptimizer": (
        "its step broadcasts every rank's shard of the parameters to the others"
    ),
}
"""Optimizer classes (and their subclasses) refused by name, with the reason: their step is not per-parameter."""

StateSignature = dict[str, tuple[tuple[int, ...], torch.dtype] | None]
"""Each key of a state the optimizer created, with its shape and dtype when it is a tensor."""

_PLAIN_VALUES = (int, float, bool, complex, type(None))


class GenericAdapter(StateSwapAdapter):
    """Swaps every large tensor state of any per-parameter optimizer by running its own ``step`` per batch.

    A dedicated adapter (Adam/AdamW, Muon, RMSprop) is still preferred for its family: the registry
    resolves the nearest registered class of the optimizer's MRO, and this one is registered for
    ``torch.optim.Optimizer`` itself.
    """

    swappable_keys = None
    lazy_states = True
    swaps_nested_states = True

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        for index, group in enumerate(optimizer.param_groups):
            refuse_differentiable(type(optimizer).__name__, group, index)
        _check_per_parameter(optimizer)
        refusal = third_party_refusal(optimizer)
        if refusal is not None:
            raise UnsupportedOptimizerError(f"{type(optimizer).__name__} cannot be swapped: {refusal}")
        self.created_keys, verdict = _probed_state_keys(optimizer)
        self._param_shaped_keys = verdict.param_shaped_keys
        self._nests = verdict.nests
        """The state keys that hold nested dicts of tensors and numbers, each value swapped by its path
        (:mod:`.nested_states`)."""
        self.needs_parameter_order = _order_needed(verdict)
        self._first_keys: set[str] = set(verdict.first_parameter_keys)
        """Keys of a group's value the step keeps in the state of the group's first parameter (a step count), lent
        to the first parameter of each batch (:mod:`.first_parameter_values`)."""
        self._later_keys: set[str] = set(verdict.later_keys)
        """Keys the step adds to a state, or removes from it, after the step that created it (seen by the probe or
        in a step since): a state may lack them or hold them."""
        self._probed_groups = snapshot(optimizer.param_groups)
        """The group values last probed or stepped: a switch since is probed again (:mod:`.group_recheck`)."""
        # Schedule-free's train()/eval() move the parameters between its sequences: run through the SwapOptimizer.
        self.outside_step_methods = outside_step_methods(optimizer)
        self._step = unhooked_step(optimizer)
        # By identity: a tensor's == is elementwise. Weak: a parameter dropped from the model is forgotten.
        self._signatures = WeakIdKeyDictionary()
        self._group_values: GroupValues | None = None
        self._narrowed: NarrowedGroups | None = None
        self._first_values: FirstParameterValues | None = None
        self._stepped = False
        self._warned_subclass = False
        for group in optimizer.param_groups:  # states made by the constructor (Adagrad's) or loaded before wrapping
            for param in group["params"]:
                state = optimizer.state.get(param)
                if state:
                    self._signatures[param] = _signature(optimizer, flat_state(state))

    def initial_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor | StateInit]:
        raise UnsupportedOptimizerError(
            f"GenericAdapter cannot tell what a fresh state of {type(self.optimizer).__name__} looks like: "
            "the optimizer's own step creates it"
        )

    def expected_states(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, StateInit]:
        """The states the probe saw the step create in the parameter's own shape and dtype (a lower bound: a state
        of another size, a factored moment, is left out)."""
        if not param.is_floating_point():
            return {}
        return {key: StateInit(tuple(param.shape), param.dtype) for key in sorted(self._param_shaped_keys)}

    @contextlib.contextmanager
    def step_scope(self) -> Iterator[None]:
        """One ``step()``: hooks silenced for the per-batch steps, group values kept per batch.

        If no batch ran the optimizer (no parameter has a gradient), its step runs once over empty
        groups, as a plain step over parameters without gradients would (it may still write group
        values, e.g. a step count). If the step fails, every group value is put back as the step found it.
        A group option switched, or a group added, since the last step is probed first (:meth:`_recheck_groups`).
        """
        self._recheck_groups()
        values = self._group_values = GroupValues(self.optimizer)
        self._narrowed = NarrowedGroups(self.optimizer)
        keys = self._first_keys
        self._first_values = FirstParameterValues(self.optimizer, frozenset(keys)) if keys else None
        self._stepped = False
        try:
            with step_hooks_silenced(self.optimizer):
                yield
                if not self._stepped:
                    self._narrowed_step(None, [], batch_index=0)
            self._probed_groups = snapshot(self.optimizer.param_groups)  # what the step wrote was probed with it
        except BaseException:
            values.put_back_start()  # a step that failed part-way leaves the group values it found
            raise
        finally:
            self._group_values = None
            self._narrowed = None
            self._first_values = None

    def _recheck_groups(self) -> None:
        """Probe the optimizer again, before any batch, when a group option switched or a group was added since the
        last probe or step; refuse, naming the switch and the probe's reason, when the step is no longer
        per-parameter (the optimizer is left as it is: nothing of it is stepped)."""
        switch = group_switch(self._probed_groups, self.optimizer.param_groups)
        if switch is None:
            return
        name = type(self.optimizer).__name__
        try:
            _, verdict = _probed_state_keys(self.optimizer)
        except UnsupportedOptimizerError as refusal:
            raise UnsupportedOptimizerError(
                f"{name} cannot step swapped with its param groups as they are now: {switch} since it was probed, "
                f"and probed again: {refusal}. Nothing was updated; set the value back (or remove the group) to go "
                "on swapping, or step this optimizer unswapped"
            ) from None
        drawn = _order_needed(verdict)
        if drawn is not None and self.needs_parameter_order is None:
            raise UnsupportedOptimizerError(
                f"{name} cannot step swapped with its param groups as they are now: {switch} since it was probed, "
                f"and probed again {drawn}. It was wrapped without such draws, so its swapped step updates the "
                "parameters whose states stay on the device first (and, with prefetch='backward' or "
                "step='in_backward', the last parameters first): the draws would land on other parameters than "
                "torch's. Nothing was updated; set the value back to go on swapping, or wrap the optimizer with the "
                "value set (its batches then follow torch's order, after the backward)"
            )
        self._later_keys.update(verdict.later_keys)
        self._first_keys.update(verdict.first_parameter_keys)
        self._nests |= verdict.nests
        self._probed_groups = snapshot(self.optimizer.param_groups)

    def update(self, batch: UpdateBatch) -> None:
        """The optimizer's own step over this group's share of the batch (every other group empty).

        With master weights the step runs on the masters, presented to it as its parameters. Called
        outside :meth:`step_scope` (swap-core always calls it inside), the batch is a step of its own.
        """
        if self._narrowed is None:
            with self.step_scope():
                self.update(batch)
            return
        # States the step is about to create (its first step): none in the usual case, told by one C-level pass.
        fresh = [] if all(batch.states) else self._fresh(batch)
        keys_before = sum(map(len, batch.states))  # a key added to a state later (an SWA average) changes it
        if batch.model_params is None:
            self._lent_step(batch)
            if not fresh and sum(map(len, batch.states)) == keys_before:
                return
            created = self._created(fresh)
        else:
            with masters_presented(self.optimizer, batch):
                self._lent_step(batch)
                created = self._created(fresh)
        if sum(map(len, batch.states)) != keys_before + sum(len(state) for _, state in created):
            self._follow_later_keys(batch, {id(owner) for _, owner in fresh})
        for owner, state in created:
            signature = _signature(self.optimizer, state)
            self._warn_about_subclass_states(state)
            if signature:  # an optimizer may keep no state for a parameter (plain SGD)
                self._signatures[owner] = signature

    def _lent_step(self, batch: UpdateBatch) -> None:
        """The narrowed step over ``batch`` (its nested dict states in their place, holding the device copies: swap-core
        places each by its path), a group's values kept in its first parameter's state lent to the batch's first one
        (:mod:`.first_parameter_values`)."""
        first_values = self._first_values
        if first_values is None:
            self._narrowed_step(batch.group, batch.params, batch_index=batch.batch_index)
            return
        owners = batch.params if batch.model_params is None else batch.model_params
        with first_values.lent(batch.group, owners, batch.params):
            self._narrowed_step(batch.group, batch.params, batch_index=batch.batch_index)

    def entries_written_beside(self, group: dict[str, Any], params: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """The group's first parameter, for a batch that writes the group's values kept in its state from outside
        (:meth:`.FirstParameterValues.entries_written_beside`)."""
        first_values = self._first_values
        return () if first_values is None else first_values.entries_written_beside(group, params)

    def _created(self, fresh: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """``(model param, state)`` of the states the step just created for ``fresh``, each nested dict's values by
        their paths (:func:`.flat_state`)."""
        entries = [(owner, self.optimizer.state.get(param, {})) for param, owner in fresh]
        self._nests |= {key for _, entry in entries for key, value in entry.items() if is_nest(value)}
        return [(owner, flat_state(entry)) for owner, entry in entries]

    def _follow_later_keys(self, batch: UpdateBatch, fresh: set[int]) -> None:
        """The step added keys to (or removed keys from) states it had created before: those keys become ones a
        state may hold or lack, and each such state's signature is its keys now."""
        owners = batch.params if batch.model_params is None else batch.model_params
        for owner, entry in zip(owners, batch.states, strict=True):
            signature: StateSignature | None = self._signatures.get(owner)  # type: ignore[no-untyped-call]
            state = flat_state(entry)
            if id(owner) in fresh or signature is None or signature.keys() == state.keys():
                continue
            self._later_keys.update(signature.keys() ^ state.keys())
            self._signatures[owner] = _signature(self.optimizer, state)

    @staticmethod
    def _fresh(batch: UpdateBatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, model param)`` of each parameter of ``batch`` without a state yet."""
        owners = batch.params if batch.model_params is None else batch.model_params
        return [
            (param, owner) for param, owner, state in zip(batch.params, owners, batch.states, strict=True) if not state
        ]

    def _warn_about_subclass_states(self, state: Mapping[str, Any]) -> None:
        """Once per optimizer: states held in tensor subclasses stay on the device (swap moves plain tensors)."""
        if self._warned_subclass:
            return
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not _is_plain_or_dtensor(value):
                self._warned_subclass = True
                warnings.warn(
                    f"{type(self.optimizer).__name__} keeps state {key!r} in a {type(value).__name__} (a tensor "
                    "subclass): such states stay on the device, unswapped (swap moves plain tensors and DTensors)",
                    UserWarning,
                    stacklevel=2,
                )
                return

    def state_mismatch(self, param: torch.Tensor, group: Mapping[str, Any], state: Mapping[str, Any]) -> str | None:
        """Compared with the state ``param`` had when wrapped, or the one the optimizer's step created for it; a key
        the step adds or removes after it created a state (:attr:`_later_keys`) may be there or not.

        Unknown (``None``) for a parameter that had none and was never stepped: a checkpoint loaded
        into a fresh optimizer is then taken as it is, as torch's load takes it.
        """
        malformed = next((key for key, value in state.items() if isinstance(value, dict) and not is_nest(value)), None)
        if malformed is not None:
            return f"holds {nest_problem(malformed, state[malformed]).removeprefix('it keeps ')}"
        state = flat_state(state)
        signature: StateSignature | None = self._signatures.get(model_param(param))  # type: ignore[no-untyped-call]
        if signature is None:
            return None
        later = self._later_keys
        expected = {
            key: None if created is None else created[0]
            for key, created in signature.items()
            if key in state or key not in later
        }
        for key in later.intersection(state).difference(expected):  # added later, not yet to this parameter's state
            expected[key] = tuple(param.shape) if key in self._param_shaped_keys else None
        return compare_state(
            state,
            expected,
            unknown=f"which {type(self.optimizer).__name__} did not create",
            wrong_shape="the optimizer created it with shape",
        )

    def _narrowed_step(self, target: dict[str, Any] | None, params: list[torch.Tensor], *, batch_index: int) -> None:
        """The optimizer's own step over ``params`` of group ``target`` (once per pipeline batch: kept lean,
        measured by ``swap-bench narrowing``)."""
        narrowed, values = self._narrowed, self._group_values
        assert narrowed is not None and values is not None, "step_scope() prepares every narrowed step"
        values.before_batch()
        narrowed.run(self._step, target, params)
        self._stepped = True
        values.after_batch(batch_index, held=target)


def _order_needed(verdict: ProbeVerdict) -> str | None:
    """Why the batches must update in torch's parameter order (:attr:`StateSwapAdapter.needs_parameter_order`): the
    step draws random numbers, which land on the parameter torch's step gives them only in that order."""
    if verdict.draws_random is None:
        return None
    return (
        f"its step draws random numbers from {verdict.draws_random}, and each draw lands on the parameter torch's "
        "step gives it only when the parameters update in torch's order"
    )


def _probed_state_keys(optimizer: torch.optim.Optimizer) -> tuple[frozenset[str] | None, ProbeVerdict]:
    """Refuse, before anything changes, an optimizer whose step the probe finds (or the class declares) not
    per-parameter, or whose states it keeps in Python objects; else the state keys the probe saw it create (``None``
    where the probe could not step a declared optimizer), and the probe's verdict."""
    name = type(optimizer).__name__
    declared = getattr(optimizer, DECLARATION, None)
    if declared is False:
        raise UnsupportedOptimizerError(
            f"{name} declares its step not per-parameter ({DECLARATION} = False): swap-generic runs the step batch "
            "by batch, which would update it wrongly; it needs a dedicated adapter (swap_core.register_adapter)"
        )
    verdict = probe_step(optimizer)
    _refuse_whatever_declared(name, verdict)
    if declared is True:
        return verdict.state_keys or None, verdict
    _refuse_undeclared(name, verdict)
    return verdict.state_keys, verdict


def _refuse_whatever_declared(name: str, verdict: ProbeVerdict) -> None:
    """The probe's refusals that no declaration settles."""
    if verdict.delegates is not None:
        raise UnsupportedOptimizerError(
            f"{name} cannot be swapped: {verdict.delegates}. swap-generic runs {name}'s own step once per batch with "
            f"{name}'s param groups narrowed to the batch and moves the states in {name}.state; it narrows no inner "
            "optimizer's groups and moves none of its states, so every batch would step every parameter of the inner "
            "optimizer. Swap each inner optimizer on its own (swap_optimizer(inner)) and step those in the training "
            "loop, or write a dedicated adapter (swap_core.register_adapter)"
        )
    if verdict.container is not None:
        raise UnsupportedOptimizerError(f"{name} cannot be swapped: {verdict.container}")
    if verdict.no_step is not None:
        raise UnsupportedOptimizerError(
            f"{name} cannot be swapped: {verdict.no_step}. It is driven outside step() (e.g. by a fused backward "
            "that updates each parameter as its gradient is computed); swap moves states to the device and back "
            "around step(), so such an optimizer needs a dedicated adapter (swap_core.register_adapter)"
        )
    if verdict.fails_apart is not None:  # no declaration makes a later batch not raise: it would half-step the model
        raise UnsupportedOptimizerError(
            f"{name}'s step cannot run batch by batch: {verdict.fails_apart}. swap-generic runs the step once per "
            "batch, so a later batch would fail after earlier ones were updated. It needs a dedicated adapter "
            "(swap_core.register_adapter)"
        )


def _refuse_undeclared(name: str, verdict: ProbeVerdict) -> None:
    """The probe's refusals that the declaration ``swap_per_parameter = True`` settles."""
    if verdict.holds_parameter is not None:
        raise UnsupportedOptimizerError(
            f"{name} cannot be swapped: {verdict.holds_parameter}, where the probe's stand-in parameters cannot take "
            "its place, so a step that reads another parameter through it (pairing LoRA's A and B by identity) was "
            "not checked; run batch by batch, or inside the backward as each batch's gradients become final, it "
            "would read its partner's gradient, value or state out of torch's order. Pair such parameters by their "
            "position in a param group (the probe checks that), or write a dedicated adapter "
            f"(swap_core.register_adapter); if the step never reads another parameter through it, declare "
            f"{name}.{DECLARATION} = True"
        )
    if verdict.coupled is not None:
        raise UnsupportedOptimizerError(
            f"{name}'s step is not per-parameter: {verdict.coupled}. swap-generic runs the step batch by batch, "
            "which would update such an optimizer wrongly; it needs a dedicated adapter (swap_core.register_adapter), "
            f"or, if the probe is wrong, the declaration {name}.{DECLARATION} = True"
        )
    if verdict.unknown is not None:
        raise UnsupportedOptimizerError(
            f"swap-generic could not check that {name}'s step is per-parameter: {verdict.unknown}. It runs the step "
            f"batch by batch, which is right only for such a step: if it is one, declare it ({name}.{DECLARATION} = "
            "True, on the class or the instance); if not, it needs a dedicated adapter (swap_core.register_adapter)"
        )


def _is_plain_or_dtensor(tensor: torch.Tensor) -> bool:
    if type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return True
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _check_per_parameter(optimizer: torch.optim.Optimizer) -> None:
    for cls in type(optimizer).__mro__:
        reason = NOT_PER_PARAMETER.get(f"{cls.__module__}.{cls.__qualname__}")
        if reason is not None:
            raise UnsupportedOptimizerError(
                f"{type(optimizer).__name__} cannot be swapped batch by batch: {reason}. swap-generic runs "
                "optimizers whose step updates each parameter from its own gradient and state only"
            )


def _signature(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> StateSignature:
    """The keys, shapes and dtypes of a ``state`` the optimizer just created."""
    signature: StateSignature = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            signature[key] = (tuple(value.shape), value.dtype)
        elif isinstance(value, _PLAIN_VALUES):
            signature[key] = None
        else:
            raise UnsupportedOptimizerError(
                f"{type(optimizer).__name__} keeps state {key!r} as a {type(value).__name__}: swap-generic moves "
                "tensor states and keeps numbers, but cannot tell where the tensors inside other objects live. "
                "Write a dedicated adapter for this optimizer"
            )
    return signature


def register(registry: AdapterRegistry) -> None:
    """Entry point of the ``swap_core.adapters`` group: the fallback for every ``torch.optim.Optimizer``."""
    registry.register(torch.optim.Optimizer, GenericAdapter, name="generic")
