"""What a failed step puts back: the parameters' values from before their batch updated them.

A swapped step updates its batches one after another, so an exception in batch k (the wrapped optimizer's own code
raising, a copy failing) comes after batches 0..k-1 were updated. Undoing those needs their parameters and their
states as they were before the step:

- on a step that creates every state it updates (the first step after wrapping, a reset or a load of no states),
  the states are new: dropping them undoes them, and the parameters are the only values to keep. A
  :class:`StepJournal` keeps them, one batch at a time right before its update, in pageable host memory
  (:meth:`~swap_core.backends.protocol.DeviceBackend.read_to_host`, ordered on the current stream: the host waits for
  it, once per batch of that one step), and the failed step puts them back: the optimizer is as before the step;
- on any other step the states of the earlier batches were already overwritten in host memory. Keeping a copy of
  every state costs host memory the size of the states and a host wait per batch, so it is kept only with
  ``SwapConfig(undo_failed_steps=True)`` (then every failed step is undone whole, states put back into their host
  mirrors); otherwise the step leaves each parameter whole (its update and its states, or neither) and the
  exception says how many batches were applied (:func:`note_partial_step`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..backends.protocol import DeviceBackend
from ..dtensor import local_tensor
from .kept_entries import KeptEntries

__all__ = ["SavedNest", "StepJournal", "note_on", "note_partial_step"]


class SavedNest(dict[str, Any]):
    """A dict nested in a state, as the journal saved it (put back into the nested dict, key by key)."""


class StepJournal:
    """What one step's updated batches held before it: their parameters, and (``keeps_states``) the states of those
    whose state existed when the step began; and the parameters it made states for."""

    def __init__(self, backend: DeviceBackend, created: list[torch.Tensor], *, keeps_states: bool) -> None:
        self._backend = backend
        self.created = created
        """Parameters without a state when the step began: the states a failed step made for them are dropped."""
        self._created_ids = set(map(id, created))
        self._keeps_states = keeps_states
        self._saved_params: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.saved_states: list[tuple[torch.Tensor, dict[str, Any]]] = []
        """``(parameter, its state before the update)``: tensors as host copies of their local values, other values
        as they were."""
        self.beside = KeptEntries()
        """Entries outside the updated batches that their updates wrote (an adapter's
        :meth:`~swap_core.adapters.StateSwapAdapter.entries_written_beside`), resident values as they were."""

    def record(self, params: Sequence[torch.Tensor], states: Sequence[Mapping[str, Any]]) -> None:
        """Keep ``params``' values (and their states'); call right before an update writes them, on the stream the
        update runs on, while each swapped state's entry is its device copy."""
        read = self._backend.read_to_host
        for param, state in zip(params, states, strict=True):
            local = local_tensor(param).detach()
            self._saved_params.append((local, read(local)))
            if self._keeps_states and id(param) not in self._created_ids:
                self.saved_states.append((param, self._saved(state)))

    def _saved(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` as it is now: tensors as host copies of their local values, a dict nested in it as a
        :class:`SavedNest` of its own values, other values as they are."""
        read = self._backend.read_to_host
        saved: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                saved[key] = read(local_tensor(value).detach())
            elif isinstance(value, dict):
                saved[key] = SavedNest(self._saved(value))
            else:
                saved[key] = value
        return saved

    def restore_params(self) -> None:
        """Put every recorded parameter back, the last recorded first."""
        for local, saved in reversed(self._saved_params):
            local.copy_(saved)
        self._saved_params.clear()


def note_on(error: BaseException, note: str) -> None:
    """Add ``note`` to ``error``'s notes, shown under its traceback (Python 3.11+; nothing before)."""
    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        add_note(note)


def note_partial_step(error: BaseException, applied: int, batches: int) -> None:
    """Tell, on ``error``, what a step that failed after ``applied`` of its ``batches`` batches left behind."""
    if applied == 0:
        return
    note_on(
        error,
        f"swap: this step failed after {applied} of its {batches} batches had updated their parameters. Each "
        "parameter holds either this step's update and the states that go with it, or neither; load a checkpoint "
        "to resume from the step before (docs/behaviour.md, 'A step that fails')",
    )
