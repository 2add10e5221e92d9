"""The simulator's ordering calls: copy streams, events, a stream's wait and the host's waits.

:class:`SimOrdering` creates copy streams (each an agent of the race checker), records events, makes a stream
wait for an event (queued on a copy stream, run at once on the eager compute stream), times two events, and
orders the host after issued work (``synchronize``, a read of device memory to the host), carrying every wait
to the race checker's vector clocks and the virtual clock. :class:`~swap_core.sim.SimBackend` delegates its
stream and event methods here.
"""

from __future__ import annotations

import torch

from swap_core.backends.protocol import Event, Stream

from .machine import SimMachine
from .streams import QueuedWait

__all__ = ["SimOrdering"]


class SimOrdering:
    """Streams, events and host waits of one :class:`~swap_core.sim.SimBackend` (see its methods of the same names)."""

    def __init__(self, machine: SimMachine) -> None:
        self._machine = machine

    def new_stream(self) -> Stream:
        """See :meth:`SimBackend.new_stream`."""
        machine = self._machine
        stream = machine.scheduler.new_stream()
        if machine.race_checker is not None:
            machine.race_checker.add_agent(stream.name)
        return stream

    def record_event(self, stream: Stream) -> Event:
        """See :meth:`SimBackend.record_event`."""
        self._machine.tick()
        return self._machine.record_event(self._machine.own_stream(stream))

    def elapsed_seconds(self, start: Event, end: Event) -> float:
        """See :meth:`SimBackend.elapsed_seconds`."""
        start_event, end_event = self._machine.own_event(start), self._machine.own_event(end)
        if start_event.modeled_at is not None and end_event.modeled_at is not None:
            return end_event.modeled_at - start_event.modeled_at
        start_event.synchronize()
        end_event.synchronize()
        assert start_event.completed_at is not None and end_event.completed_at is not None
        return end_event.completed_at - start_event.completed_at

    def wait_event(self, stream: Stream, event: Event) -> None:
        """See :meth:`SimBackend.wait_event`."""
        machine = self._machine
        machine.tick()
        sim_stream, sim_event = machine.own_stream(stream), machine.own_event(event)
        if machine.race_checker is not None and sim_event.snapshot is not None:
            machine.race_checker.wait(sim_stream.name, sim_event.snapshot)
        if machine.clock is not None and sim_event.modeled_at is not None:
            machine.clock.wait(sim_stream.name, sim_event.modeled_at)
        if sim_event.done:
            return
        if sim_stream.is_compute:
            machine.scheduler.force(sim_event.stream, sim_event.position)
            return
        machine.scheduler.enqueue(sim_stream, QueuedWait(sim_event))
        if machine.sync:
            machine.scheduler.drain(sim_stream)

    def synchronize(self) -> None:
        """See :meth:`SimBackend.synchronize`."""
        machine = self._machine
        machine.tick()
        machine.scheduler.drain_all()
        if machine.race_checker is not None:
            machine.race_checker.host_waits_all()
        if machine.clock is not None:
            machine.clock.host_waits(machine.clock.latest())

    def read_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """See :meth:`SimBackend.read_to_host`."""
        machine = self._machine
        machine.tick()
        stream = machine.issue_on_current()
        if machine.race_checker is not None:
            machine.race_checker.host_waits_for(stream)
        if machine.clock is not None:
            nbytes = tensor.numel() * tensor.element_size()
            machine.clock.host_waits(machine.clock.issue_transfer(stream, "d2h", nbytes))
        return tensor.detach().clone()
