"""swap-ckpt: torch.distributed.checkpoint (DCP) for models with swapped optimizers."""

from __future__ import annotations

from .__about__ import __version__
from .app_state import AppState
from .errors import CheckpointFileError, CheckpointMismatchError, StateInitDivergenceError
from .flat_state import is_flat_optimizer_state, nest_flat_optimizer_state
from .host_snapshot import LiveMemory, host_copy, host_snapshot, private_destinations, private_host_bytes
from .init_guard import check_uniform_state_init, initialize_swapped_states, needs_state_init
from .loading import load_checkpoint
from .planner import StrictLoadPlanner
from .reader import CheckedFileSystemReader

__all__ = [
    "AppState",
    "CheckedFileSystemReader",
    "CheckpointFileError",
    "CheckpointMismatchError",
    "LiveMemory",
    "StateInitDivergenceError",
    "StrictLoadPlanner",
    "__version__",
    "check_uniform_state_init",
    "host_copy",
    "host_snapshot",
    "initialize_swapped_states",
    "is_flat_optimizer_state",
    "load_checkpoint",
    "needs_state_init",
    "nest_flat_optimizer_state",
    "private_destinations",
    "private_host_bytes",
]
