"""``load_checkpoint``: ``dcp.load`` with the checks a resumed training run wants, and plain exceptions."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load

from .planner import StrictLoadPlanner
from .reader import CheckedFileSystemReader, check_metadata

__all__ = ["load_checkpoint"]


def load_checkpoint(
    state_dict: dict[str, Any],
    checkpoint_dir: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """``dcp.load(state_dict, ...)`` that refuses another model's checkpoint and truncated files.

    Extra FQNs raise :class:`~swap_ckpt.errors.CheckpointMismatchError`, a missing FQN
    torch's ``RuntimeError`` and a shape mismatch its ``ValueError`` (each naming the
    FQN), a missing or unreadable ``.metadata`` and missing or short data files
    :class:`~swap_ckpt.errors.CheckpointFileError` (naming the file); all before any
    tensor is read, so nothing live changes. DCP gathers failures into a
    ``CheckpointException``, a ``BaseException`` that ``except Exception`` misses; this
    re-raises the lowest failing rank's own exception instead (the same one on every
    rank), chained to it.
    """
    check_metadata(checkpoint_dir)
    try:
        load(
            state_dict,
            storage_reader=CheckedFileSystemReader(checkpoint_dir),
            planner=StrictLoadPlanner(),
            process_group=process_group,
        )
    except CheckpointException as gathered:
        failures = gathered.failures
        if not failures:
            raise
        first_rank = min(failures)
        raise failures[first_rank][0] from gathered
