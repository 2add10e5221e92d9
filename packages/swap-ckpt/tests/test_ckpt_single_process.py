"""AppState in one process (no process group): Muon + AdamW checkpoints, torch's init step, snapshots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_training import build_layers, local_snapshot
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from swap_ckpt import (
    AppState,
    CheckpointFileError,
    host_snapshot,
    live_storages,
    load_checkpoint,
    needs_state_init,
)
from swap_ckpt.flat_state import is_flat_optimizer_state, nest_flat_optimizer_state
from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

pytestmark = [pytest.mark.sim_only, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

CONFIG = SwapConfig(backend="sim", swap_times=2, min_numel=32)


def _muon_adamw(*, swapped: bool) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    """Muon for the two weight matrices, AdamW for the biases, as one would train with both."""
    model = build_layers()
    matrices = [param for param in model.parameters() if param.dim() == 2]
    vectors = [param for param in model.parameters() if param.dim() != 2]
    optimizers: list[torch.optim.Optimizer] = [
        torch.optim.Muon(matrices, lr=2e-2, momentum=0.95, weight_decay=0.01),
        torch.optim.AdamW(vectors, lr=1e-2, weight_decay=0.1),
    ]
    if swapped:
        optimizers = [swap_optimizer(optimizer, CONFIG) for optimizer in optimizers]
    return model, optimizers


def _train(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], first_step: int, steps: int) -> None:
    for step in range(first_step, first_step + steps):
        inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        model(inputs).square().mean().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def _snapshot(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    return [local_snapshot(model, optimizer) for optimizer in optimizers]


def _assert_equal(expected: list[dict[str, Any]], actual: list[dict[str, Any]], context: str) -> None:
    for index, (want, got) in enumerate(zip(expected, actual, strict=True)):
        for fqn, tensor in want["model"].items():
            assert_bitwise_equal(tensor, got["model"][fqn], f"{context}: model {fqn}")
        assert_state_dicts_equal(want["optim"], got["optim"], f"{context}: optimizer {index}")


def test_muon_and_adamw_resume_bitwise_and_load_into_plain_optimizers(tmp_path: Path) -> None:
    model, optimizers = _muon_adamw(swapped=True)
    _train(model, optimizers, 0, 3)
    at_save = _snapshot(model, optimizers)
    dcp.save({"app": AppState(model, optimizers)}, checkpoint_id=tmp_path)
    _train(model, optimizers, 3, 2)
    final = _snapshot(model, optimizers)

    resumed_model, resumed = _muon_adamw(swapped=True)
    dcp.load({"app": AppState(resumed_model, resumed)}, checkpoint_id=tmp_path)
    _assert_equal(at_save, _snapshot(resumed_model, resumed), "swapped load")
    _train(resumed_model, resumed, 3, 2)
    _assert_equal(final, _snapshot(resumed_model, resumed), "swapped resume")

    plain_model, plain = _muon_adamw(swapped=False)
    load_checkpoint({"app": AppState(plain_model, plain)}, tmp_path)
    _assert_equal(at_save, _snapshot(plain_model, plain), "swapped -> plain")
    _train(plain_model, plain, 3, 2)
    _assert_equal(final, _snapshot(plain_model, plain), "plain resume from a swapped checkpoint")


def test_fresh_swapped_optimizer_gets_its_states_without_torch_init_step() -> None:
    """get_state_dict on a fresh optimizer: plain torch runs a zero-gradient lr-0 step; swapped states need none.

    Same moments as the plain optimizer, no copy and no device byte, parameters unchanged; only the step
    counter differs: torch's fake step counts (``step`` 1), the swapped state is the one before any step.
    """
    model = build_layers()
    swapped = swap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), CONFIG)
    plain_model = build_layers()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, weight_decay=0.1)
    params_before = [param.detach().clone() for param in model.parameters()]
    assert needs_state_init(swapped)
    assert isinstance(swapped.backend, SimBackend)
    swapped.backend.reset_copy_stats()

    swapped_state = AppState(model, swapped).state_dict()
    plain_state = AppState(plain_model, plain).state_dict()

    assert not needs_state_init(swapped)
    copies = swapped.backend.copy_stats
    assert copies.h2d_copies == copies.d2h_copies == 0 and swapped.backend.memory_allocated() == 16 * 4 * 2
    for fqn, plain_entry in plain_state["optim"]["state"].items():
        entry = swapped_state["optim"]["state"][fqn]
        assert plain_entry["step"].item() == 1 and entry["step"].item() == 0, fqn
        for key in ("exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(plain_entry[key], entry[key], f"{fqn} {key}")
    for index, (before, param) in enumerate(zip(params_before, model.parameters(), strict=True)):
        assert_bitwise_equal(before, param, f"parameter {index} after initializing")


def test_checkpoint_of_a_never_stepped_swapped_optimizer_resumes_exactly(tmp_path: Path) -> None:
    """Saved before its first step and resumed, a swapped run equals the uninterrupted one (torch's is a step ahead)."""
    model, optimizers = _muon_adamw(swapped=True)
    dcp.save({"app": AppState(model, optimizers)}, checkpoint_id=tmp_path / "fresh")
    _train(model, optimizers, 0, 3)
    uninterrupted = [local_snapshot(model, optimizer) for optimizer in optimizers]

    model, optimizers = _muon_adamw(swapped=True)
    dcp.load({"app": AppState(model, optimizers)}, checkpoint_id=tmp_path / "fresh")
    _train(model, optimizers, 0, 3)
    for index, optimizer in enumerate(optimizers):
        actual = local_snapshot(model, optimizer)
        assert_state_dicts_equal(uninterrupted[index]["optim"], actual["optim"], f"optimizer {index}")
        for fqn, tensor in uninterrupted[index]["model"].items():
            assert_bitwise_equal(tensor, actual["model"][fqn], f"model {fqn}")


def test_flattened_optimizer_state_nests_by_its_own_keys() -> None:
    model, optimizers = _muon_adamw(swapped=False)
    _train(model, optimizers, 0, 1)
    nested = get_optimizer_state_dict(model, optimizers)
    flat = get_optimizer_state_dict(model, optimizers, options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert is_flat_optimizer_state(flat) and not is_flat_optimizer_state(nested)
    rebuilt = nest_flat_optimizer_state(flat, optimizers)
    assert_state_dicts_equal({"state": nested["state"], "param_groups": []}, {**rebuilt, "param_groups": []}, "state")
    for group in nested["param_groups"]:  # one group per FQN, each with its group's options
        for fqn in group["params"]:
            (own,) = [candidate for candidate in rebuilt["param_groups"] if candidate["params"] == [fqn]]
            assert own == {**group, "params": [fqn]}
    with pytest.raises(ValueError, match=r"'param_groups\.0\.weight\.nope' names no option"):
        nest_flat_optimizer_state({**flat, "param_groups.0.weight.nope": 1}, optimizers)
    with pytest.raises(ValueError, match=r"'state\.9\.weight\.exp_avg' belongs to no parameter"):
        nest_flat_optimizer_state({**flat, "state.9.weight.exp_avg": torch.zeros(1)}, optimizers)


def test_state_dict_holds_host_copies_not_the_live_host_mirrors() -> None:
    """The async-save mechanism: what DCP reads is a copy, so later steps cannot change a pending save."""
    model = build_layers()
    optimizer = swap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), CONFIG)
    assert isinstance(optimizer, SwapOptimizer) and isinstance(optimizer.backend, SimBackend)
    _train(model, [optimizer], 0, 1)
    saved = AppState(model, optimizer).state_dict()["optim"]
    expected = host_snapshot(saved)
    live = {id(value) for state in optimizer.state.values() for value in state.values()}
    live_storages = {
        value.untyped_storage().data_ptr()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    }
    for fqn, state in saved["state"].items():
        for key, value in state.items():
            assert id(value) not in live, f"{fqn}.{key} is the live state object"
            assert value.untyped_storage().data_ptr() not in live_storages, f"{fqn}.{key} shares live storage"
    _train(model, [optimizer], 1, 2)
    assert_state_dicts_equal(expected, saved, "state dict after two more steps")


def test_snapshot_with_optimizers_copies_only_what_shares_live_storage() -> None:
    """Fresh tensors (distributed Muon's exported shards, a full state dict) are private already: no second copy."""
    model = build_layers()
    optimizer = swap_optimizer(torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2)), CONFIG)
    _train(model, [optimizer], 0, 1)
    saved = optimizer.state_dict()
    first = next(iter(saved["state"]))
    fresh = saved["state"][first]["exp_avg"].clone()
    live_view = saved["state"][first]["exp_avg_sq"][:3]  # a view of a host mirror: the same storage
    saved["state"][first] = {**saved["state"][first], "exp_avg": fresh, "view": live_view}
    snapshot = host_snapshot(saved, [optimizer])
    assert snapshot["state"][first]["exp_avg"] is fresh
    live = live_storages([optimizer])
    for fqn, state in snapshot["state"].items():
        for key, value in state.items():
            if value is not fresh:
                assert (value.device, value.untyped_storage().data_ptr()) not in live, f"{fqn}.{key} is live"
    assert torch.equal(snapshot["state"][first]["view"], live_view)
    # The tensor learning rate is a live hyper-parameter (schedulers fill it in place): copied too.
    assert snapshot["param_groups"][0]["lr"] is not optimizer.param_groups[0]["lr"]
    assert torch.equal(snapshot["param_groups"][0]["lr"], optimizer.param_groups[0]["lr"])
    # Without optimizers every tensor is copied, as before.
    assert host_snapshot(saved)["state"][first]["exp_avg"] is not fresh


def test_truncated_checkpoint_names_the_file_and_leaves_state_untouched(tmp_path: Path) -> None:
    model = build_layers()
    optimizer = swap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), CONFIG)
    _train(model, [optimizer], 0, 2)
    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=tmp_path)
    _train(model, [optimizer], 2, 1)
    before = local_snapshot(model, optimizer)
    (data_file,) = tmp_path.glob("*.distcp")
    data_file.write_bytes(data_file.read_bytes()[:-1])
    with pytest.raises(CheckpointFileError, match=rf"Checkpoint file {data_file} is truncated: \d+ bytes"):
        load_checkpoint({"app": AppState(model, optimizer)}, tmp_path)
    after = local_snapshot(model, optimizer)
    assert_state_dicts_equal(before["optim"], after["optim"], "optimizer after a truncated checkpoint")
    for fqn, tensor in before["model"].items():
        assert_bitwise_equal(tensor, after["model"][fqn], f"model {fqn} after a truncated checkpoint")


def test_app_state_refuses_bad_arguments() -> None:
    model = build_layers()
    with pytest.raises(TypeError, match=r"optimizers\[1\] must be a torch.optim.Optimizer, got Linear"):
        AppState(model, [torch.optim.SGD(model.parameters()), torch.nn.Linear(1, 1)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one optimizer"):
        AppState(model, [])
    app = AppState(model, torch.optim.SGD(model.parameters()))
    with pytest.raises(KeyError, match=r"missing \['optim'\]"):
        app.load_state_dict({"model": {}})
