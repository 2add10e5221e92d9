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
    CheckpointMismatchError,
    LiveMemory,
    host_snapshot,
    load_checkpoint,
    needs_state_init,
)
from swap_ckpt.flat_state import is_flat_optimizer_state, nest_flat_optimizer_state
from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.sim import MemoryKind, SimBackend
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


def _swapped_adamw(steps: int) -> tuple[torch.nn.Module, SwapOptimizer, SimBackend]:
    model = build_layers()
    optimizer = swap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), CONFIG)
    assert isinstance(optimizer, SwapOptimizer) and isinstance(optimizer.backend, SimBackend)
    _train(model, [optimizer], 0, steps)
    return model, optimizer, optimizer.backend


def _mirror_storages(optimizer: SwapOptimizer) -> dict[tuple[int, str], int]:
    """(parameter index, key) -> storage address of each swapped state's host mirror."""
    assert isinstance(optimizer.backend, SimBackend)
    index = {id(param): i for i, param in enumerate(optimizer.param_groups[0]["params"])}
    mirrors = {
        (index[id(param)], key): value.untyped_storage().data_ptr()
        for param, state in optimizer.state.items()
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and optimizer.backend.memory_kind(value) is MemoryKind.HOST
    }
    assert mirrors, "nothing is swapped"
    return mirrors


def _optimizer_tensor_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (what a full private copy of it holds)."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def test_a_save_reads_the_live_host_mirrors_in_place() -> None:
    """No host copy for a save: the state dict DCP writes holds the host mirrors themselves."""
    model, optimizer, sim = _swapped_adamw(1)
    app = AppState(model, optimizer)
    saved = app.state_dict()["optim"]
    assert app.private_host_bytes == 0
    mirrors = _mirror_storages(optimizer)
    swapped = [v for state in saved["state"].values() for v in state.values() if sim.memory_kind(v) is MemoryKind.HOST]
    assert len(swapped) == len(mirrors), "a swapped state was saved from a copy"
    assert {value.untyped_storage().data_ptr() for value in swapped} == set(mirrors.values())


def test_an_async_save_holds_exactly_dcps_one_copy_and_later_steps_cannot_reach_it(tmp_path: Path) -> None:
    """``dcp.async_save`` stages the mirrors before it returns: one copy (DCP's), none of ours."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    def optimizer_storages(state_dict: dict[str, Any]) -> dict[int, int]:
        """Storage address -> bytes of every tensor of an optimizer state dict's ``state``."""
        return {
            value.untyped_storage().data_ptr(): value.untyped_storage().nbytes()
            for state in state_dict["state"].values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        }

    class CountingStager(DefaultStager):
        staged_from: dict[int, int] = {}
        staged_bytes = 0

        def stage(self, state_dict: Any, **kwargs: Any) -> Any:
            self.staged_from = optimizer_storages(state_dict["app"]["optim"])
            staged = super().stage(state_dict, **kwargs)
            self.staged_bytes = sum(optimizer_storages(staged["app"]["optim"]).values())
            return staged

    model, optimizer, _ = _swapped_adamw(2)
    expected = local_snapshot(model, optimizer)
    app = AppState(model, optimizer)
    live = optimizer_storages({"state": optimizer.state})
    stager = CountingStager(StagingOptions(False, False, False, False))
    future = dcp.async_save({"app": app}, checkpoint_id=tmp_path, async_stager=stager)
    assert stager.staged_from == live, "DCP staged from a copy of ours, not from the live state"
    assert stager.staged_bytes == sum(live.values()), "DCP's stage is not exactly one copy of the state"
    assert app.private_host_bytes == 0
    _train(model, [optimizer], 2, 2)  # steps while the save is still being written
    future.result()
    stager.close()
    resumed_model, resumed = _swapped_adamw(0)[:2]
    load_checkpoint({"app": AppState(resumed_model, resumed)}, tmp_path)
    _assert_equal([expected], [local_snapshot(resumed_model, resumed)], "the async save")


@pytest.mark.parametrize("in_place", [False, True], ids=["private", "in_place"])
def test_a_checked_load_holds_one_private_copy_or_none(tmp_path: Path, in_place: bool) -> None:
    """``load_checkpoint`` reads into private host tensors (exactly the state's bytes), or into the mirrors.

    Either way the optimizer copies into its live host mirrors (no second host layout) and resumes bitwise.
    """
    model, optimizer, _ = _swapped_adamw(2)
    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=tmp_path)
    expected = local_snapshot(model, optimizer)
    _train(model, [optimizer], 2, 1)
    resumed_model, resumed, sim = _swapped_adamw(1)  # a run with state of its own, to be replaced
    mirrors = _mirror_storages(resumed)
    app = AppState(resumed_model, resumed)
    sim.reset_peak_memory_stats()
    pinned = sim.host_pinned_bytes()
    load_checkpoint({"app": app}, tmp_path, in_place=in_place)
    assert app.private_host_bytes == (0 if in_place else _optimizer_tensor_bytes(resumed))
    assert sim.max_host_pinned_bytes() == pinned, "the load built a second host layout"
    assert _mirror_storages(resumed) == mirrors, "the host mirrors moved"
    _assert_equal([expected], [local_snapshot(resumed_model, resumed)], "after the load")
    uninterrupted_model, uninterrupted, _ = _swapped_adamw(2)
    _train(uninterrupted_model, [uninterrupted], 2, 2)
    _train(resumed_model, [resumed], 2, 2)
    want, got = local_snapshot(uninterrupted_model, uninterrupted), local_snapshot(resumed_model, resumed)
    _assert_equal([want], [got], "two steps after the load")


def test_a_checkpoint_of_another_dtype_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    """DCP would cast it silently while writing into the state; ``load_checkpoint`` names it instead."""
    model, optimizer, _ = _swapped_adamw(1)
    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=tmp_path)
    bf16_model = build_layers().to(torch.bfloat16)
    bf16 = swap_optimizer(torch.optim.AdamW(bf16_model.parameters(), lr=1e-2), CONFIG)
    for param in bf16_model.parameters():
        param.grad = torch.ones_like(param)
    bf16.step()
    before = local_snapshot(bf16_model, bf16)
    with pytest.raises(CheckpointMismatchError, match=r"tensors of another dtype.*0\.weight \(torch.float32 in the"):
        load_checkpoint({"app": AppState(bf16_model, bf16)}, tmp_path, in_place=True)
    _assert_equal([before], [local_snapshot(bf16_model, bf16)], "after the refused load")


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
    live = LiveMemory([optimizer])
    assert live_view in live and fresh not in live
    for fqn, state in snapshot["state"].items():
        for key, value in state.items():
            assert value not in live, f"{fqn}.{key} is live"
    assert torch.equal(snapshot["state"][first]["view"], live_view)
    # The tensor learning rate is a live hyper-parameter (schedulers fill it in place): copied too.
    assert snapshot["param_groups"][0]["lr"] is not optimizer.param_groups[0]["lr"]
    assert torch.equal(snapshot["param_groups"][0]["lr"], optimizer.param_groups[0]["lr"])
    # Without optimizers every tensor is copied, as before.
    assert host_snapshot(saved)["state"][first]["exp_avg"] is not fresh


@pytest.mark.parametrize("in_place", [False, True], ids=["private", "in_place"])
def test_truncated_checkpoint_names_the_file_and_leaves_state_untouched(tmp_path: Path, in_place: bool) -> None:
    model = build_layers()
    optimizer = swap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), CONFIG)
    _train(model, [optimizer], 0, 2)
    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=tmp_path)
    _train(model, [optimizer], 2, 1)
    before = local_snapshot(model, optimizer)
    (data_file,) = tmp_path.glob("*.distcp")
    data_file.write_bytes(data_file.read_bytes()[:-1])
    with pytest.raises(CheckpointFileError, match=rf"Checkpoint file {data_file} is truncated: \d+ bytes"):
        load_checkpoint({"app": AppState(model, optimizer)}, tmp_path, in_place=in_place)
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
