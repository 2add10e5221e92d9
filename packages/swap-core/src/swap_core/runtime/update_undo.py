"""What taking back a provisional update needs besides the swapped states: the parameters and the resident states.

A batch updated provisionally (inside the backward, until ``step()`` commits it) copies its swapped states out to
their spare host copies, so their mirrors still hold the state before the step. The update also writes, in place on
the device, the batch's parameters and its states that stay resident (small ones, step counters). They are kept:

- a parameter with an fp32 master needs nothing: it is its master rounded, and its master's mirror still holds the
  master before the step (:meth:`UpdateUndo.keep_from_master`); a take-back copies it in and rounds it again;
- any other parameter's local tensor is copied to a pinned host buffer of its own (made once, reused every step) on
  the copy stream when its batch is copied in (:meth:`UpdateUndo.keep_params`), so that the copy runs beside the
  walk's; the update waits for it (:meth:`UpdateUndo.wait_for_params`). One more copy of the parameter's bytes
  device-to-host per step;
- each resident state tensor is cloned where it lives (a device copy for a device tensor, a host one for a step
  counter on the CPU) right before the update, and other values are kept as they are (:meth:`UpdateUndo.keep_states`).

:meth:`UpdateUndo.restore` puts them back (the host waits for every copy first); :meth:`UpdateUndo.clear` forgets
them once the step committed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..backends.protocol import DeviceBackend, Event, Stream
from ..dtensor import local_tensor
from ..errors import SwapStateError
from .kept_entries import KeptEntries

__all__ = ["UpdateUndo"]


class UpdateUndo:
    """The parameters and resident states of the batches updated provisionally, as they were before."""

    def __init__(self, backend: DeviceBackend) -> None:
        self._backend = backend
        self._host_params: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """A pinned host buffer per parameter, made at its first keep and reused (dropped with the parameter)."""
        self._kept_params: list[tuple[torch.Tensor, torch.Tensor]] = []
        """``(parameter's local tensor, its host buffer)`` of each parameter kept since the last clear."""
        self._kept_states = KeptEntries()
        """The state entries of each parameter kept since the last clear, with their resident values as they were."""
        self._from_masters: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        """``(parameter, its local tensor, its master's host mirror)`` of each parameter restored from its master."""
        self._left: list[tuple[torch.Tensor, torch.Tensor]] = []
        """``(local tensor, master's host mirror)`` of the parameters a take-back left to the step that follows it."""

    def __bool__(self) -> bool:
        return bool(self._kept_params or self._kept_states or self._from_masters)

    @property
    def host_bytes(self) -> int:
        """Host bytes of the parameters' buffers."""
        buffers: list[torch.Tensor] = list(self._host_params.values())  # type: ignore[no-untyped-call]
        return sum(buffer.numel() * buffer.element_size() for buffer in buffers)

    def keep_params(self, params: Iterable[torch.Tensor], *, compute: Stream, copy_stream: Stream) -> Event | None:
        """Copy ``params`` to their host buffers on ``copy_stream``, after the work issued to ``compute`` so far (an
        earlier update of theirs); the event an update that writes them must wait for (``None``: nothing copied)."""
        backend = self._backend
        pairs = [(param, local_tensor(param.detach())) for param in params]
        if not pairs:
            return None
        backend.wait_event(copy_stream, backend.record_event(compute))
        for param, local in pairs:
            host = self._host_buffer(param, local)
            backend.copy(host, local, stream=copy_stream)
            self._kept_params.append((local, host))
        return backend.record_event(copy_stream)

    def wait_for_params(self, kept: Event | None, *, compute: Stream) -> None:
        """Before an update on ``compute`` writes the parameters :meth:`keep_params` copied out (``kept``)."""
        if kept is not None:
            self._backend.wait_event(compute, kept)

    def keep_from_master(self, param: torch.Tensor, master_mirror: torch.Tensor) -> None:
        """``param`` is its fp32 master rounded, and ``master_mirror`` (the master's host mirror) holds the master as
        it was: a take-back rounds it again into ``param``."""
        self._from_masters.append((param, local_tensor(param.detach()), master_mirror))

    def keep_states(self, states: Iterable[tuple[dict[str, Any], frozenset[str]]]) -> None:
        """The resident values of each ``(state entry, its swapped keys)``, as they are now (right before an
        update)."""
        self._kept_states.keep(states)

    def restore(self, *, compute: Stream, left_to_a_step: Callable[[torch.Tensor], bool] | None = None) -> None:
        """Put every kept parameter and resident state back (the host waits for the copies), then forget them.

        ``left_to_a_step``: the step runs again right after, and rounds again from its master, as it was, every
        parameter with a master for which this is true (it has a gradient): those are left to it, not copied in
        twice. Should that step fail, :meth:`restore_left` rounds them from their masters as the failure left them;
        once it ran, :meth:`forget_left`."""
        backend = self._backend
        backend.synchronize()  # the copies out of the parameters have landed
        failed: list[torch.Tensor] = []
        for local, host in reversed(self._kept_params):
            _twice(failed, local, functools.partial(backend.copy, local, host, stream=compute))
        for param, local, master in self._from_masters:
            if left_to_a_step is not None and left_to_a_step(param):
                self._left.append((local, master))
            else:
                _twice(failed, local, functools.partial(self._round_from, local, master, compute))
        self._kept_states.put_back()
        backend.synchronize()  # the host buffers are free to be written by the next keep
        self.clear()
        _refuse_failed(failed)

    def restore_left(self, *, compute: Stream) -> None:
        """The step a take-back left parameters to failed: each is rounded again from its master's mirror, which
        that step's recovery made current (the master it updated, or the one from before), so that every parameter
        is its master rounded."""
        backend = self._backend
        left, self._left = self._left, []
        backend.synchronize()  # the failed step's copies out of the masters have landed
        failed: list[torch.Tensor] = []
        for local, master in left:
            _twice(failed, local, functools.partial(self._round_from, local, master, compute))
        backend.synchronize()
        _refuse_failed(failed)

    def forget_left(self) -> None:
        """The step a take-back left parameters to ran: it rounded them again."""
        self._left = []

    def _round_from(self, local: torch.Tensor, master: torch.Tensor, compute: Stream) -> None:
        """``local`` set from the master in host memory ``master``, rounded to nearest even as the update sets it."""
        on_device = self._backend.empty(master.shape, master.dtype)
        self._backend.copy(on_device, master, stream=compute)
        with torch.no_grad():
            local.copy_(on_device)

    def clear(self) -> None:
        """Forget what was kept (the step committed)."""
        self._kept_params = []
        self._kept_states.clear()
        self._from_masters = []

    def _host_buffer(self, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """``param``'s pinned host buffer, laid out as its local tensor (made at its first keep)."""
        buffer: torch.Tensor | None = self._host_params.get(param)  # type: ignore[no-untyped-call]
        if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
            flat = self._backend.empty_host(local.numel(), local.dtype)
            buffer = flat.view(local.shape) if local.is_contiguous() else flat.as_strided(local.shape, local.stride())
            self._host_params[param] = buffer
        return buffer


def _twice(failed: list[torch.Tensor], local: torch.Tensor, put_back: Callable[[], object]) -> None:
    """``put_back()`` (one parameter's copy back), tried again once if it raises (a copy refused for a moment); the
    parameter's local tensor added to ``failed`` if it raises again, and the others put back all the same."""
    for _ in range(2):
        try:
            put_back()
        except Exception:  # every other parameter is still put back; reported by the caller
            continue
        return
    failed.append(local)


def _refuse_failed(failed: list[torch.Tensor]) -> None:
    """Raise, after everything else was put back, when some parameters could not be."""
    if failed:
        raise SwapStateError(
            f"Taking back the updates made inside the backward could not put back {len(failed)} parameter(s) (the "
            f"first of shape {tuple(failed[0].shape)}): their copies back failed twice. They hold their provisional "
            "values while the optimizer's states are as before that backward; reload the model and the optimizer "
            "from a checkpoint"
        )
