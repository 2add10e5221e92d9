"""The simulator's calls on the virtual clock itself: modeled work, modeled host reads, and where the clock stands.

:class:`SimModeledTime` puts work the simulator does not run (a forward and backward) on the compute stream's
virtual timeline, puts the collectives' traffic between ranks on the link's (when the link says the network card
shares it), makes the host wait for the current stream as a read of a computed value would, reports the
stream and host times as :class:`~swap_core.backends.protocol.ModeledTimes`, and opens the window in which the
first copy's start is noted (:mod:`~swap_core.backends.sim.timing`). :class:`~swap_core.sim.SimBackend`
delegates its virtual-clock methods here.
"""

from __future__ import annotations

from .machine import SimMachine
from .timing import ModeledTimes, VirtualClock

__all__ = ["SimModeledTime"]

_NETWORK_IN, _NETWORK_OUT = "network-in", "network-out"
"""The virtual timelines of the collectives' bytes received and sent (a ring sends while it receives)."""


class SimModeledTime:
    """The virtual clock's face on one :class:`~swap_core.sim.SimBackend` (see its methods of the same names)."""

    def __init__(self, machine: SimMachine) -> None:
        self._machine = machine

    def model_compute(self, seconds: float) -> None:
        """See :meth:`SimBackend.model_compute`."""
        clock = self._clock("model_compute")
        if not seconds >= 0:
            raise ValueError(f"model_compute needs seconds >= 0, got {seconds!r}")
        clock.issue(self._machine.current_stream().name, seconds)

    def model_collective(self, received_bytes: int, sent_bytes: int) -> float:
        """See :meth:`SimBackend.model_collective`."""
        clock = self._clock("model_collective")
        if received_bytes < 0 or sent_bytes < 0:
            raise ValueError(f"model_collective needs bytes >= 0, got {received_bytes!r} and {sent_bytes!r}")
        clock.issue_collective(_NETWORK_OUT, "d2h", sent_bytes)
        return clock.issue_collective(_NETWORK_IN, "h2d", received_bytes)

    def model_wait(self, until: float) -> None:
        """See :meth:`SimBackend.model_wait`."""
        self._clock("model_wait").wait(self._machine.current_stream().name, until)

    def _clock(self, method: str) -> VirtualClock:
        clock = self._machine.clock
        if clock is None:
            raise ValueError(f"{method} needs a virtual clock: SimBackend(timing=LinkModel(...))")
        return clock

    def model_host_read(self) -> None:
        """See :meth:`SimBackend.model_host_read`."""
        clock = self._clock("model_host_read")
        clock.host_waits(clock.free_at(self._machine.current_stream().name))

    def modeled_times(self) -> ModeledTimes | None:
        """See :meth:`SimBackend.modeled_times`."""
        clock = self._machine.clock
        if clock is None:
            return None
        copies = [clock.free_at(stream.name) for stream in self._machine.scheduler.copy_streams]
        compute = clock.free_at(self._machine.current_stream().name)
        return ModeledTimes(clock.host, compute, max(copies, default=0.0), clock.transfers_started)

    def start_transfer_window(self) -> None:
        """See :meth:`SimBackend.start_transfer_window`."""
        if self._machine.clock is not None:
            self._machine.clock.start_transfer_window()
