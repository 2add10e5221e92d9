"""``load_checkpoint``: ``dcp.load`` with the checks a resumed training run wants, and plain exceptions."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.stateful import Stateful

from .app_state import OPTIM_KEY, AppState
from .planner import StrictLoadPlanner
from .reader import CheckedFileSystemReader, check_metadata
from .saved_without_masters import as_saved_without_masters

__all__ = ["load_checkpoint"]


def load_checkpoint(
    state_dict: dict[str, Any],
    checkpoint_dir: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    in_place: bool = False,
) -> None:
    """``dcp.load(state_dict, ...)`` that refuses another model's checkpoint and truncated files.

    Extra FQNs and tensors of another dtype raise :class:`~swap_ckpt.errors.CheckpointMismatchError`,
    a missing FQN torch's ``RuntimeError`` and a shape mismatch its ``ValueError`` (each naming
    the FQN), a missing or unreadable ``.metadata`` and missing or short data files
    :class:`~swap_ckpt.errors.CheckpointFileError` (naming the file); all before any tensor is
    read, so nothing live changes. DCP gathers failures into a ``CheckpointException``, a
    ``BaseException`` that ``except Exception`` misses; this re-raises the lowest failing rank's
    own exception instead (the same one on every rank), chained to it.

    Host memory: each :class:`~swap_ckpt.AppState` is read into its :meth:`~swap_ckpt.AppState.load_target`,
    private host tensors as large as this rank's optimizer state, and only then loaded into the
    optimizers, which check it all before writing. ``in_place=True`` reads straight into the live
    state instead (as ``dcp.load`` does): no extra host memory, but a read that fails after the
    checks (an I/O error) leaves the state partly overwritten; load again. Other ``Stateful``
    values and plain entries are loaded as ``dcp.load`` loads them.

    A checkpoint saved without master weights loads into optimizers with ``master_weights=True``:
    their masters start as the loaded parameters and the loaded states are kept in fp32, with one
    warning naming how many (as ``SwapOptimizer.load_state_dict`` does).
    """
    metadata = check_metadata(checkpoint_dir)
    keys = sorted(state_dict)  # as dcp.load: every rank loads its entries in the same order
    targets = {key: _load_target(state_dict[key], in_place=in_place) for key in keys}
    for key in keys:
        if isinstance(state_dict[key], AppState):  # saved without master weights, loaded with them
            optim = targets[key][OPTIM_KEY]
            targets[key][OPTIM_KEY] = as_saved_without_masters(optim, metadata, f"{key}.{OPTIM_KEY}")
    _load_with_plain_exceptions(targets, checkpoint_dir, process_group)
    for key in keys:
        value = state_dict[key]
        if isinstance(value, Stateful):
            value.load_state_dict(targets[key])
        else:
            state_dict[key] = targets[key]


def _load_with_plain_exceptions(
    targets: dict[str, Any], checkpoint_dir: str | os.PathLike[str], process_group: dist.ProcessGroup | None
) -> None:
    """``dcp.load`` into ``targets``, strictly checked, raising the lowest failing rank's own exception (chained to
    DCP's ``CheckpointException``) instead of the gathered one."""
    try:
        load(
            targets,
            storage_reader=CheckedFileSystemReader(checkpoint_dir),
            planner=StrictLoadPlanner(exact_dtypes=True),
            process_group=process_group,
        )
    except CheckpointException as gathered:
        failures = gathered.failures
        if not failures:
            raise
        first_rank = min(failures)
        raise failures[first_rank][0] from gathered


def _load_target(value: Any, *, in_place: bool) -> Any:
    if isinstance(value, AppState):
        return value.load_target(in_place=in_place)
    if isinstance(value, Stateful):
        return value.state_dict()
    return value
