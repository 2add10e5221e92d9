"""DCP checkpoints with flattened optimizer state dicts (``flatten_optimizer_state_dict=True``), FSDP2 on 2 ranks.

torch's flattening turns the optimizer state dict into one level of keys,
``state.<fqn>.<name>`` and ``param_groups.<fqn>.<hyperparameter>``. Two
process worlds, as in a real restart: the first trains swapped AdamW, saves,
trains more and records the uninterrupted run (the
:data:`~ckpt_training.FSDP_FLATTENED` row of
:func:`~ckpt_training.train_save_and_record`); it also checks interop with
plain AdamW both ways and that a flattened and a nested checkpoint refuse each
other's state. The second world, new processes, loads the checkpoint (with
``load_checkpoint`` and with plain ``dcp.load``) and resumes: bitwise the
uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_training import (
    FSDP_FLATTENED,
    Loader,
    assert_snapshots_equal,
    check_interop_both_ways,
    local_snapshot,
    resume_bitwise,
    train_save_and_record,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from swap_ckpt import AppState, CheckpointMismatchError, load_checkpoint
from swap_core.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.sim_only]

PARAM_FQNS = ("0.weight", "0.bias", "2.weight", "2.bias")
ADAMW_STATES = ("step", "exp_avg", "exp_avg_sq")


def _first_world(rank: int, world_size: int, directory: Path) -> None:
    model, optimizer, at_save = train_save_and_record(FSDP_FLATTENED, rank, directory)
    check_interop_both_ways(FSDP_FLATTENED, rank, directory, at_save)
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
        load_checkpoint(FSDP_FLATTENED.app(model, optimizer), directory / "nested")
    assert_snapshots_equal(before, local_snapshot(model, optimizer), f"rank {rank} after nested -> flattened")


def _load_with_dcp(state_dict: dict[str, Any], checkpoint: Path) -> None:
    dcp_load(state_dict, checkpoint_id=checkpoint)


def _resume_world(rank: int, world_size: int, directory: Path) -> None:
    loaders: tuple[Loader, ...] = (load_checkpoint, _load_with_dcp)
    for loader in loaders:
        resume_bitwise(FSDP_FLATTENED, rank, directory, loader=loader)


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
    run_distributed(_first_world, FSDP_FLATTENED.world_size, tmp_path)
    _assert_optimizer_keys_flattened(tmp_path / "swapped")
    _assert_optimizer_keys_flattened(tmp_path / "plain")
    run_distributed(_resume_world, FSDP_FLATTENED.world_size, tmp_path)
