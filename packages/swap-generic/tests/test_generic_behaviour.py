"""What the generic adapter does beyond the conformance rows: registration, hooks, group values, refusals."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from swap_core import SwapConfig, UpdateBatch, swap_optimizer
from swap_core.adapters.registry import default_registry
from swap_core.errors import UnsupportedOptimizerError
from swap_core.sim import SimBackend
from swap_core.testing.pairs import ConformanceCase, Pair, make_pair, make_params, set_grads
from swap_generic import GenericAdapter

CPU = torch.device("cpu")


def _case(make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer], name: str = "generic") -> ConformanceCase:
    return ConformanceCase(name, make, skip_grad_every=0)


DEFAULT = _case(lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9))


def _params() -> list[torch.Tensor]:
    return make_params(DEFAULT, CPU)


def _set_grads(params: list[torch.Tensor], step: int) -> None:
    set_grads(DEFAULT, params, step)


def _config(**options: Any) -> SwapConfig:
    return SwapConfig(backend=SimBackend(mode="random", seed=3), swap_times=3, min_numel=64, **options)


def _pair(make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]) -> Pair:
    return make_pair(_case(make), SimBackend(mode="random", seed=3))


def _step_both(pair: Pair, steps: int) -> None:
    pair.step_both(steps)
    pair.assert_params_equal(f"after {steps} steps")


# -- registration --------------------------------------------------------------------
def test_generic_serves_optimizers_without_a_dedicated_adapter() -> None:
    for optimizer_cls in (torch.optim.SGD, torch.optim.Adagrad, torch.optim.NAdam, torch.optim.Adafactor):
        assert default_registry.resolve(optimizer_cls(_params(), lr=0.01)) is GenericAdapter, optimizer_cls


def test_dedicated_adapters_win_by_mro() -> None:
    rmsprop = swap_optimizer(torch.optim.RMSprop(_params(), lr=0.01), _config())
    assert type(rmsprop.adapter).__name__ == "RMSpropAdapter"
    pytest.importorskip("swap_adam")
    adamw = swap_optimizer(torch.optim.AdamW(_params(), lr=0.01), _config())
    assert type(adamw.adapter).__name__ == "AdamAdapter"


@pytest.mark.parametrize("optimizer_cls", [torch.optim.LBFGS])
def test_optimizers_that_are_not_per_parameter_are_refused(optimizer_cls: type[torch.optim.Optimizer]) -> None:
    optimizer = optimizer_cls(_params(), lr=0.1)
    with pytest.raises(UnsupportedOptimizerError, match=r"LBFGS cannot be swapped batch by batch: it evaluates"):
        swap_optimizer(optimizer, _config())


# -- one step() is one step ------------------------------------------------------------
class _ClampingSGD(torch.optim.SGD):
    """A subclass whose step does something of its own and then calls the parent's (hooked) step."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.clamp_(-0.5, 0.5)
        return super().step(closure)


@pytest.mark.parametrize("optimizer_cls", [torch.optim.SGD, _ClampingSGD], ids=["sgd", "subclass_calling_super"])
def test_step_hooks_and_closure_run_once_per_step(optimizer_cls: type[torch.optim.SGD]) -> None:
    torch.optim.SGD(_params(), lr=0.1)  # SGD.step itself is now hooked: a subclass's super().step() reaches hooks
    params = _params()
    swapped = swap_optimizer(optimizer_cls(params, lr=0.1, momentum=0.9), _config())
    calls: list[str] = []
    swapped.register_step_pre_hook(lambda *_: calls.append("pre"))
    swapped.optimizer.register_step_post_hook(lambda *_: calls.append("post"))
    handles = [
        register_optimizer_step_pre_hook(lambda *_: calls.append("global pre")),
        register_optimizer_step_post_hook(lambda *_: calls.append("global post")),
    ]
    try:
        for step in range(3):
            _set_grads(params, step)
            swapped.step(lambda: calls.append("closure") or 0.0)
            assert swapped.stats.batches == 3
    finally:
        for handle in handles:
            handle.remove()
    assert calls == ["global pre", "pre", "closure", "post", "global post"] * 3


def test_a_step_without_any_gradient_still_runs_the_optimizer_once() -> None:
    """Its group values advance as a plain step over parameters without gradients advances them."""
    pair = _pair(lambda groups: _CountingSGD(groups, lr=0.1))
    _step_both(pair, 2)
    for optimizer in (pair.reference, pair.swapped):
        for param in pair.reference_params + pair.swapped_params:
            param.grad = None
        optimizer.step()
    assert pair.reference.param_groups[0]["k"] == pair.swapped.param_groups[0]["k"] == 3


# -- param group values a step writes ----------------------------------------------------
class _CountingSGD(torch.optim.Optimizer):
    """Writes its step count into its group, as schedule-free AdamW writes ``k``, and reads it back."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr, "k": 0})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            k = group["k"] + 1
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["sum"] = torch.zeros_like(param)
                state["sum"].add_(param.grad)
                param.add_(state["sum"], alpha=-group["lr"] / k)
            group["k"] = k
        return None


def test_group_values_written_by_the_step_end_as_after_one_plain_step() -> None:
    pair = _pair(lambda groups: _CountingSGD(groups, lr=0.1))
    _step_both(pair, 5)
    assert pair.reference.param_groups[0]["k"] == pair.swapped.param_groups[0]["k"] == 5
    assert pair.swapped.stats.batches == 3


class _BatchDependentGroupWrite(_CountingSGD):
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            group["seen"] = len(group["params"])
        return super().step(closure)


def test_a_group_value_written_differently_per_batch_is_refused_at_wrap_time() -> None:
    params = _params()
    plain = _BatchDependentGroupWrite(params, lr=0.1)
    with pytest.raises(UnsupportedOptimizerError, match=r"wrote param group 0's 'seen' differently \(2 against 1\)"):
        swap_optimizer(plain, _config())
    assert "seen" not in plain.param_groups[0] and not plain.state


def test_a_group_value_written_differently_per_batch_is_still_refused_at_the_step_when_declared() -> None:
    """Declared per-parameter, the probe's verdict is overruled; the per-batch check still refuses the step."""
    params = _params()

    class Declared(_BatchDependentGroupWrite):
        swap_per_parameter = True

    swapped = swap_optimizer(Declared(params, lr=0.1), _config())
    _set_grads(params, 0)
    with pytest.raises(UnsupportedOptimizerError, match=r"param group 0's 'seen' as \d+ for the first batch"):
        swapped.step()


def _append_to_first_group(optimizer: torch.optim.Optimizer) -> None:
    optimizer.param_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(3)))


def _fill_empty_groups(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        if not group["params"]:
            group["params"].append(torch.nn.Parameter(torch.zeros(3)))


def _replace_the_list(optimizer: torch.optim.Optimizer) -> None:
    optimizer.param_groups = list(optimizer.param_groups)


def _add_a_group(optimizer: torch.optim.Optimizer) -> None:
    optimizer.param_groups.append({**optimizer.defaults, "params": []})


def _replace_a_group(optimizer: torch.optim.Optimizer) -> None:
    optimizer.param_groups[-1] = dict(optimizer.param_groups[-1])


def _share_the_params(optimizer: torch.optim.Optimizer) -> None:
    first, *rest = optimizer.param_groups
    for group in rest:
        group["params"] = first["params"]


EDITS = {
    "append to the first group": _append_to_first_group,
    "fill the empty groups": _fill_empty_groups,
    "replace param_groups": _replace_the_list,
    "add a group": _add_a_group,
    "replace a group": _replace_a_group,
    "one list in every group": _share_the_params,
}
ONLY_WITH_SEVERAL_GROUPS = {"fill the empty groups", "one list in every group"}


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("edit", list(EDITS))
def test_every_edit_of_param_groups_inside_step_is_refused_and_undone(edit: str, groups: int) -> None:
    """Whatever a step does to the groups it was given, the batch is refused and the groups are put back as
    they were (the same list, dicts and "params" lists), one group or several."""
    params = _params()
    edits = EDITS[edit]

    class Editing(_CountingSGD):
        active = False  # off while swap-generic probes the step at wrap time (it would refuse some edits there)

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            if self.active:
                edits(self)
            return super().step(closure)

    split = [{"params": params[:2]}, {"params": params[2:], "lr": 0.05}] if groups == 2 else params
    swapped = swap_optimizer(Editing(split, lr=0.1), _config())
    Editing.active = True
    inner = swapped.optimizer
    groups_before, members_before = inner.param_groups, list(inner.param_groups)
    lists_before = [(group["params"], len(group["params"])) for group in members_before]
    _set_grads(params, 0)
    if groups == 1 and edit in ONLY_WITH_SEVERAL_GROUPS:
        swapped.step()  # nothing to edit with one group (it always holds the batch): the step is the plain one
        return
    with pytest.raises(UnsupportedOptimizerError, match="changed param_groups"):
        swapped.step()
    assert inner.param_groups is groups_before and len(groups_before) == len(members_before)
    assert all(now is before for now, before in zip(groups_before, members_before, strict=True))
    assert [(group["params"], len(group["params"])) for group in groups_before] == lists_before
    assert all(group["params"] is before for group, (before, _) in zip(groups_before, lists_before, strict=True))


def test_update_outside_step_scope_is_a_step_of_its_own() -> None:
    """swap-core calls update() inside step_scope(); called alone, one batch is one plain step."""
    params, reference = _params(), _params()
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    plain = torch.optim.SGD(reference, lr=0.1, momentum=0.9)
    adapter = GenericAdapter(optimizer)
    for step in range(3):
        _set_grads(params, step)
        _set_grads(reference, step)
        states = [optimizer.state.get(param, {}) for param in params]
        adapter.update(UpdateBatch(optimizer.param_groups[0], params, [p.grad for p in params], states, 0))
        plain.step()
    for param, expected in zip(params, reference, strict=True):
        assert torch.equal(param, expected)
        assert torch.equal(optimizer.state[param]["momentum_buffer"], plain.state[expected]["momentum_buffer"])


class _ListStateSGD(_CountingSGD):
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        super().step(closure)
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param].setdefault("history", [])
        return None


def test_a_state_held_in_a_python_object_is_refused_at_wrap_time() -> None:
    params = _params()
    plain = _ListStateSGD(params, lr=0.1)
    with pytest.raises(UnsupportedOptimizerError, match=r"keeps state 'history' as a list"):
        swap_optimizer(plain, _config())
    assert not plain.state, "the probe stepped stand-ins only"


# -- states -------------------------------------------------------------------------
def test_fresh_states_are_created_by_the_step_and_land_in_host_memory() -> None:
    params = _params()
    backend = SimBackend(mode="lazy")
    swapped = swap_optimizer(torch.optim.Rprop(params, lr=0.01), SwapConfig(backend=backend, swap_times=3))
    with pytest.raises(UnsupportedOptimizerError, match=r"initialize_state\(\) cannot create the states of Rprop"):
        swapped.initialize_state()
    assert not swapped.state
    _set_grads(params, 0)
    swapped.step()
    swapped.synchronize()
    expected = 0
    for param in params:
        state = swapped.state[param]
        assert set(state) == {"step", "prev", "step_size"}
        for key in ("prev", "step_size"):
            if param.numel() >= 1024:
                assert not backend.owns(state[key]), f"{key} of a {tuple(param.shape)} parameter is not on the host"
                expected += state[key].numel() * state[key].element_size()
            else:
                assert backend.owns(state[key])
        assert backend.owns(state["step"]) and state["step"].numel() == 1
    assert swapped.stats.host_state_bytes >= expected > 0


def test_generic_adapter_over_adam_matches_plain_adam() -> None:
    """The dedicated family, driven through the generic path explicitly (a cross-check of both)."""
    case = dataclasses.replace(
        _case(lambda groups: torch.optim.Adam(groups, lr=0.01, amsgrad=True)), adapter_factory=GenericAdapter
    )
    pair = make_pair(case, SimBackend(mode="random", seed=3))
    assert isinstance(pair.swapped.adapter, GenericAdapter)
    _step_both(pair, 6)
    pair.assert_equal("Adam through the generic adapter")


class GlobalNormSGD(torch.optim.Optimizer):
    """A documented test double of an optimizer that is not per-parameter.

    Each update is scaled by the norm of the whole group's gradient (as global-norm clipping inside an
    optimizer would be): run batch by batch, every batch would see another norm. swap-generic must refuse
    it at wrap time rather than step it wrongly.
    """

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            grads = [param.grad for param in group["params"] if param.grad is not None]
            if not grads:
                continue
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(grad) for grad in grads]))
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad / norm.clamp(min=1.0), alpha=-group["lr"])
        return None


def test_an_optimizer_that_couples_parameters_is_refused_at_wrap_time() -> None:
    params = _params()
    plain = GlobalNormSGD(params, lr=0.1)
    before = [param.detach().clone() for param in params]
    with pytest.raises(UnsupportedOptimizerError, match=r"GlobalNormSGD's step is not per-parameter: stepping two"):
        swap_optimizer(plain, _config())
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True)), "the probe changed a parameter"
    assert not plain.state and plain.param_groups[0]["params"] == params
    assert not plain._optimizer_step_post_hooks, "the refused wrap left a hook behind"


def test_sparse_gradients_are_refused_clearly() -> None:
    embedding = torch.nn.Embedding(4096, 16, sparse=True)
    swapped = swap_optimizer(torch.optim.Adagrad(embedding.parameters(), lr=0.01), _config())
    embedding(torch.tensor([1, 5, 9])).sum().backward()
    before = embedding.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"has a sparse gradient; swapping supports dense gradients only"):
        swapped.step()
    assert torch.equal(before, embedding.weight.detach())


def test_an_optimizer_of_sparse_gradients_only_is_refused_at_wrap_time() -> None:
    embedding = torch.nn.Embedding(4096, 16, sparse=True)
    with pytest.raises(UnsupportedOptimizerError, match=r"SparseAdam does not support dense gradients"):
        swap_optimizer(torch.optim.SparseAdam(embedding.parameters(), lr=0.01), _config())


def test_plain_sgd_keeps_no_state_as_torch() -> None:
    pair = _pair(lambda groups: torch.optim.SGD(groups, lr=0.1))
    _step_both(pair, 3)
    assert not pair.reference.state and not pair.swapped.state
    pair.assert_equal("plain SGD")


def test_master_weights_through_swap_optimizer_run_on_the_generic_adapter() -> None:
    """test_generic_master_weights.py holds every row bitwise; here: the registry's pick supports the mode."""
    params = [torch.nn.Parameter(torch.randn(64, 64).bfloat16())]
    config = SwapConfig(backend=SimBackend(), min_numel=16, master_weights=True)
    optimizer = swap_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), config)
    params[0].grad = torch.ones_like(params[0])
    optimizer.step()
    state = optimizer.state[params[0]]
    assert sorted(state) == ["master_remainder", "momentum_buffer"]  # a bf16 parameter's master: its remainder
    assert state["master_remainder"].dtype == torch.uint8 and state["momentum_buffer"].dtype == torch.float32
