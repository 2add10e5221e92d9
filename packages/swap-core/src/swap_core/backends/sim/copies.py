"""The simulator's copies between host and device memory: issued on a stream, checked, counted and timed.

:class:`SimCopies` decides each copy's direction from the memory it joins (refusing what a real device could
not run asynchronously), checks its accesses against the race checker, counts it in :class:`CopyStats`, puts
its bytes on the virtual clock's link, and runs it at once or queues it on its copy stream. It also carries the
one-shot copy fault a test arms. :class:`~swap_core.sim.SimBackend` delegates ``copy`` here.
"""

from __future__ import annotations

import dataclasses

import torch

from swap_core.backends.protocol import Stream
from swap_core.errors import SimPageableCopyError
from swap_core.torch_compat import storage_id

from .copy_stats import CopyStats
from .faults import CopyFault
from .machine import SimMachine
from .memory import MemoryKind, StorageRecord, byte_span, storage_key
from .race_checker import AccessRequest
from .streams import QueuedCopy, SimStream

__all__ = ["SimCopies"]


class SimCopies:
    """Copies of one :class:`~swap_core.sim.SimBackend`, and their counts."""

    def __init__(self, machine: SimMachine) -> None:
        self._machine = machine
        self.stats = CopyStats()
        """Copies and bytes per direction since construction or :meth:`reset_stats`."""
        self._fault: CopyFault | None = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        """See :meth:`SimBackend.copy`."""
        machine = self._machine
        # The hot path of sync mode without checks: keep it to lookups, counters and the copy itself.
        if machine.ticks_on_every_call:
            machine.tick()
        sim_stream = machine.own_stream(stream)
        records = machine.registry.records
        dst_record = records.get(storage_id(dst.untyped_storage()))
        src_record = records.get(storage_id(src.untyped_storage()))
        direction = _copy_direction(dst, src, dst_record, src_record, machine.device)
        nbytes = dst.numel() * dst.element_size()
        fault = self._fault
        if fault is not None and fault.fires(direction):
            self._fault = None
            raise fault.error(direction, nbytes)
        self.stats.add(direction, nbytes)
        if machine.race_checker is not None:
            self._record_copy(sim_stream, direction, dst, dst_record, src, src_record)
        clock = machine.clock
        copied_at = clock.issue_transfer(sim_stream.name, direction, nbytes) if clock else 0.0
        pageable = (dst_record is not None and dst_record.is_pageable) or (
            src_record is not None and src_record.is_pageable
        )
        self._run_or_queue(sim_stream, QueuedCopy(dst, src, direction), dst_record, src_record, pageable=pageable)
        if pageable and machine.race_checker is not None:
            machine.race_checker.host_waits_for(sim_stream.name)
        if pageable and clock is not None:  # a copy from pageable memory blocks the host
            clock.host_waits(copied_at)

    def _run_or_queue(
        self,
        stream: SimStream,
        op: QueuedCopy,
        dst_record: StorageRecord | None,
        src_record: StorageRecord | None,
        *,
        pageable: bool,
    ) -> None:
        """Run the copy now (on the compute stream, or in sync mode behind an empty queue), else queue it; a
        pageable side makes it run before the call returns."""
        machine = self._machine
        if stream.is_compute:
            machine.execute_copy(op)
        elif machine.sync and not stream.queue:
            stream.enqueued += 1
            stream.completed += 1
            machine.execute_copy(op)
        else:
            # A queued copy keeps the memory it touches, not the program's tensors: the program may let go of a
            # registered host buffer while the copy is in flight, and the simulator must see it (see memory.py).
            op.dst, op.src = _detached(op.dst, dst_record), _detached(op.src, src_record)
            machine.scheduler.enqueue(stream, op)
            if machine.sync or pageable:
                machine.scheduler.drain(stream)

    def _record_copy(
        self,
        stream: SimStream,
        direction: str,
        dst: torch.Tensor,
        dst_record: StorageRecord | None,
        src: torch.Tensor,
        src_record: StorageRecord | None,
    ) -> None:
        """Check the copy's accesses; a plain CPU tensor on the device side is adopted so that later ops on it
        are ordered against this copy too (an optimizer state created by torch, copied to host memory)."""
        machine = self._machine
        assert machine.race_checker is not None
        requests = []
        for tensor, record, is_write in ((src, src_record, False), (dst, dst_record, True)):
            if tensor.numel() == 0:
                continue
            if record is None:
                record = machine.registry.register(tensor, MemoryKind.DEVICE)
            requests.append(AccessRequest(storage_key(tensor), record.kind.value, *byte_span(tensor), is_write))
        machine.race_checker.access(stream.name, requests, f"copy {direction}")

    def fail(self, at: int, direction: str | None) -> None:
        """See :meth:`SimBackend.fail_copy`."""
        self._fault = CopyFault(at, direction)

    def reset_stats(self) -> None:
        """Zero :attr:`stats` in place (references to it stay valid)."""
        for field in dataclasses.fields(self.stats):
            setattr(self.stats, field.name, 0)


def _detached(tensor: torch.Tensor, record: StorageRecord | None) -> torch.Tensor:
    """``tensor`` itself, or for registered host memory the same view of its storage through a tensor of its own
    (which keeps the bytes alive, but not the program's tensor, whose collection frees the buffer)."""
    if record is None or not record.registered:
        return tensor
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


def _copy_direction(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_record: StorageRecord | None,
    src_record: StorageRecord | None,
    device: torch.device,
) -> str:
    """``"h2d"``, ``"d2h"`` or ``"d2d"``; raises for copies a real device could not run asynchronously."""
    if not (dst.device == device and src.device == device):
        raise ValueError(f"SimBackend copies {device} tensors only, got dst on {dst.device} and src on {src.device}")
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(
            f"SimBackend.copy needs matching shapes and dtypes, got dst {tuple(dst.shape)} {dst.dtype} "
            f"and src {tuple(src.shape)} {src.dtype}"
        )
    dst_host = dst_record is not None and dst_record.is_host
    src_host = src_record is not None and src_record.is_host
    if dst_host and src_host:
        raise ValueError(
            "SimBackend.copy moves data between host and device, but dst and src are both host memory "
            "from empty_host(); copy host buffers with Tensor.copy_"
        )
    if src_host:
        return "h2d"
    if dst_host:
        return "d2h"
    if dst_record is None or src_record is None:
        plain = "src" if src_record is None else "dst"
        raise SimPageableCopyError(
            f"SimBackend.copy got a plain CPU tensor as {plain} ({tuple(src.shape)} {src.dtype}) with no host "
            "buffer on the other side: the simulator treats it as pageable host memory, which an asynchronous "
            "copy cannot use. Allocate host buffers with empty_host(); declare device tensors such as parameters "
            "and gradients with adopt()."
        )
    return "d2d"
