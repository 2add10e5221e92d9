"""swap-ckpt: torch.distributed.checkpoint (DCP) for models with swapped optimizers."""

from __future__ import annotations

from .__about__ import __version__
from .app_state import AppState
from .errors import CheckpointFileError, CheckpointMismatchError, StateInitDivergenceError
from .host_snapshot import host_copy, host_snapshot
from .init_guard import check_uniform_state_init, needs_state_init
from .loading import load_checkpoint
from .planner import StrictLoadPlanner
from .reader import CheckedFileSystemReader

__all__ = [
    "AppState",
    "CheckedFileSystemReader",
    "CheckpointFileError",
    "CheckpointMismatchError",
    "StateInitDivergenceError",
    "StrictLoadPlanner",
    "__version__",
    "check_uniform_state_init",
    "host_copy",
    "host_snapshot",
    "load_checkpoint",
    "needs_state_init",
]
