"""Errors of swap-ckpt; each also subclasses swap-core's error and the matching builtin."""

from __future__ import annotations

from swap_core.errors import StateDictMismatchError, SwapError, SwapStateError

__all__ = ["CheckpointFileError", "CheckpointMismatchError", "StateInitDivergenceError"]


class CheckpointMismatchError(StateDictMismatchError):
    """A checkpoint holds entries (FQNs) that the state being loaded does not have."""


class StateInitDivergenceError(SwapStateError):
    """Ranks disagree on whether an optimizer needs torch's state-initializing step (collectives would hang)."""


class CheckpointFileError(SwapError, OSError):
    """A checkpoint file is missing or shorter than its metadata says (a truncated or partial copy)."""
