"""What a failed step puts back: the parameters' values from before their batch updated them.

A swapped step updates its batches one after another, so an exception in batch k (the wrapped optimizer's own code
raising, a copy failing) comes after batches 0..k-1 were updated. Undoing those needs their parameters and their
states as they were before the step:

- on a step that creates every state it updates (the first step after wrapping, a reset or a load of no states),
  the states are new: dropping them undoes them, and the parameters are the only values to keep. A
  :class:`StepJournal` keeps them, one batch at a time right before its update, in pageable host memory
  (:meth:`~swap_core.backends.protocol.DeviceBackend.read_to_host`, ordered on the current stream: the host waits for
  it, once per batch of that one step), and the failed step puts them back: the optimizer is as before the step;
- on any other step the states of the earlier batches were already overwritten in host memory, and keeping a copy
  of every state would double the host memory swapping exists to use well: the step leaves each parameter whole
  (its update and its states, or neither) and the exception says how many batches were applied
  (:func:`note_partial_step`).
"""

from __future__ import annotations

import torch

from ..backends.protocol import DeviceBackend
from .dtensor import local_tensor

__all__ = ["StepJournal", "note_partial_step"]


class StepJournal:
    """The parameters of one step's updated batches, as they were before it, and the parameters it made states for."""

    def __init__(self, backend: DeviceBackend, created: list[torch.Tensor]) -> None:
        self._backend = backend
        self.created = created
        """Parameters without a state when the step began: the states a failed step made for them are dropped."""
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(self, params: list[torch.Tensor]) -> None:
        """Keep ``params``' values; call right before an update writes them (on the stream the update runs on)."""
        for param in params:
            local = local_tensor(param).detach()
            self._saved.append((local, self._backend.read_to_host(local)))

    def restore(self) -> None:
        """Put every recorded parameter back, the last recorded first."""
        for local, saved in reversed(self._saved):
            local.copy_(saved)
        self._saved.clear()


def note_partial_step(error: BaseException, applied: int, batches: int) -> None:
    """Tell, on ``error``, what a step that failed after ``applied`` of its ``batches`` batches left behind."""
    add_note = getattr(error, "add_note", None)  # Python 3.11+
    if add_note is None or applied == 0:
        return
    add_note(
        f"swap: this step failed after {applied} of its {batches} batches had updated their parameters. Each "
        "parameter holds either this step's update and the states that go with it, or neither; load a checkpoint "
        "to resume from the step before (docs/behaviour.md, 'A step that fails')"
    )
