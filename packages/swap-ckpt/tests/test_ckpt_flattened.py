"""DCP checkpoints with flattened optimizer state dicts (``flatten_optimizer_state_dict=True``), FSDP2 on 2 ranks.

torch's flattening turns the optimizer state dict into one level of keys,
``state.<fqn>.<name>`` and ``param_groups.<fqn>.<hyperparameter>``. Two
process worlds, as in a real restart: the first trains 3 steps with swapped
AdamW, saves, trains 2 more and records the uninterrupted run with
``torch.save``; it also checks interop with plain AdamW both ways and that a
flattened and a nested checkpoint refuse each other's state. The second world,
new processes, loads the checkpoint (with ``load_checkpoint`` and with plain
``dcp.load``) and trains the same 2 steps: bitwise the uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_training import (
    adamw,
    assert_snapshots_equal,
    build_layers,
    check_interop_both_ways,
    local_snapshot,
    shard,
    train,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from swap_ckpt import AppState, CheckpointMismatchError, load_checkpoint
from swap_core.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.sim_only]

WORLD_SIZE = 2
FIRST, SECOND = 3, 2
FLATTENED = StateDictOptions(flatten_optimizer_state_dict=True)
PARAM_FQNS = ("0.weight", "0.bias", "2.weight", "2.bias")
ADAMW_STATES = ("step", "exp_avg", "exp_avg_sq")

Loader = Callable[[dict[str, Any], Path], None]


def _reference(world_size: int, *, swapped: bool, rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = shard(build_layers(), world_size)
    return model, adamw(model, swapped=swapped, seed=rank)


def _flattened(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"app": AppState(model, optimizer, options=FLATTENED)}


def _first_world(rank: int, world_size: int, directory: Path) -> None:
    model, optimizer = _reference(world_size, swapped=True, rank=rank)
    train(model, optimizer, 0, FIRST, rank)
    at_save = local_snapshot(model, optimizer)
    dcp_save(_flattened(model, optimizer), checkpoint_id=directory / "swapped")
    train(model, optimizer, FIRST, SECOND, rank)
    torch.save({"at_save": at_save, "final": local_snapshot(model, optimizer)}, directory / f"expected_{rank}.pt")

    check_interop_both_ways(
        lambda swapped: _reference(world_size, swapped=swapped, rank=rank),
        rank,
        directory,
        at_save,
        steps=FIRST,
        options=FLATTENED,
    )
    _flattened_and_nested_refuse_each_other(model, optimizer, rank, directory)


def _flattened_and_nested_refuse_each_other(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, directory: Path
) -> None:
    """A run that switched the option: the param-group entries differ, named before any tensor is read."""
    dcp_save({"app": AppState(model, optimizer)}, checkpoint_id=directory / "nested")
    before = local_snapshot(model, optimizer)
    with pytest.raises(CheckpointMismatchError, match=r"holds 44 entries .*: app\.optim\.param_groups\.0\.bias\."):
        load_checkpoint({"app": AppState(model, optimizer)}, directory / "swapped")
    assert_snapshots_equal(before, local_snapshot(model, optimizer), f"rank {rank} after flattened -> nested")
    with pytest.raises(CheckpointMismatchError, match=r"holds 12 entries .*: app\.optim\.param_groups\.0\.amsgrad"):
        load_checkpoint(_flattened(model, optimizer), directory / "nested")
    assert_snapshots_equal(before, local_snapshot(model, optimizer), f"rank {rank} after nested -> flattened")


def _load_with_dcp(state_dict: dict[str, Any], checkpoint: Path) -> None:
    dcp_load(state_dict, checkpoint_id=checkpoint)


def _resume_world(rank: int, world_size: int, directory: Path) -> None:
    expected = torch.load(directory / f"expected_{rank}.pt", weights_only=True)
    loaders: dict[str, Loader] = {"load_checkpoint": load_checkpoint, "dcp.load": _load_with_dcp}
    for name, loader in loaders.items():
        model, optimizer = _reference(world_size, swapped=True, rank=rank)
        loader(_flattened(model, optimizer), directory / "swapped")
        assert_snapshots_equal(expected["at_save"], local_snapshot(model, optimizer), f"rank {rank} {name}")
        train(model, optimizer, FIRST, SECOND, rank)
        assert_snapshots_equal(expected["final"], local_snapshot(model, optimizer), f"rank {rank} {name} resume")


def _assert_optimizer_keys_flattened(checkpoint: Path) -> None:
    """Exactly one entry per parameter and state or hyperparameter, FQN-keyed.

    The ``state`` keys alone prove nothing: DCP joins nested keys with dots
    too, so a nested checkpoint stores ``app.optim.state.0.weight.exp_avg`` as
    well. Only the param groups differ: ``param_groups.0.lr`` and
    ``param_groups.0.params`` when nested, one entry per FQN when flattened.
    """
    hyperparameters = [key for key in torch.optim.AdamW([torch.zeros(1)]).param_groups[0] if key != "params"]
    expected = {f"app.optim.state.{fqn}.{name}" for fqn in PARAM_FQNS for name in ADAMW_STATES}
    expected |= {f"app.optim.param_groups.{fqn}.{name}" for fqn in PARAM_FQNS for name in hyperparameters}
    saved = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    assert {key for key in saved if key.startswith("app.optim.")} == expected


def test_flattened_optimizer_state_checkpoints(tmp_path: Path) -> None:
    run_distributed(_first_world, WORLD_SIZE, tmp_path)
    _assert_optimizer_keys_flattened(tmp_path / "swapped")
    _assert_optimizer_keys_flattened(tmp_path / "plain")
    run_distributed(_resume_world, WORLD_SIZE, tmp_path)
