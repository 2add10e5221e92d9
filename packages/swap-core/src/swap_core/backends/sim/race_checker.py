"""Happens-before race detection over the host, the compute stream and every copy stream.

Each *agent* (``"host"``, ``"compute"``, one per copy stream) carries a vector clock.
The rules are CUDA's: work launched by the host is ordered after everything the
host did before launching it (every enqueue joins the host's clock into the
stream's); an event snapshots its stream's clock when it is recorded;
``wait_event`` joins that snapshot into the waiting stream; the host joins it on
``Event.synchronize`` and joins every stream on a device ``synchronize``.

Accesses are checked when they are *issued*, in program order, not when a lazy
queue happens to execute them: a race is a missing ordering, whether or not the
simulator's schedule made it visible. Two accesses to overlapping bytes of one
storage race when they come from different agents, at least one writes, and the
later one's clock has not seen the earlier one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from swap_core.errors import SimRaceError

__all__ = ["COMPUTE_AGENT", "HOST_AGENT", "AccessRequest", "OnRace", "RaceChecker", "VectorClock"]

HOST_AGENT = "host"
COMPUTE_AGENT = "compute"

VectorClock = dict[str, int]
"""Agent name -> number of that agent's accesses known to have happened before."""

OnRace = Literal["raise", "record"]


@dataclass(frozen=True, slots=True)
class AccessRequest:
    """Bytes ``[lo, hi)`` of one registered storage that an operation reads or writes."""

    key: int
    memory: str
    lo: int
    hi: int
    is_write: bool


@dataclass(frozen=True, slots=True)
class _Access:
    """An access already issued, kept in its storage's history."""

    lo: int
    hi: int
    agent: str
    time: int
    is_write: bool
    op: str


class RaceChecker:
    """Vector clocks per agent and access histories per storage."""

    def __init__(self, on_race: OnRace = "raise") -> None:
        self.on_race: OnRace = on_race
        self.races: list[str] = []
        self._clocks: dict[str, VectorClock] = {HOST_AGENT: {HOST_AGENT: 0}, COMPUTE_AGENT: {COMPUTE_AGENT: 0}}
        self._history: dict[int, list[_Access]] = {}

    def add_agent(self, agent: str) -> None:
        """Start the clock of a new copy stream."""
        self._clocks[agent] = {agent: 0}

    # -- ordering -------------------------------------------------------------
    def launch(self, agent: str) -> VectorClock:
        """The host issues work to ``agent``: that work is ordered after all the host did so far."""
        clock = self._clocks[agent]
        if agent != HOST_AGENT:
            _join(clock, self._clocks[HOST_AGENT])
        return clock

    def snapshot(self, agent: str) -> VectorClock:
        """The clock an event recorded now on ``agent`` carries."""
        return dict(self.launch(agent))

    def wait(self, agent: str, snapshot: Mapping[str, int]) -> None:
        """``agent`` waits for an event: everything before the event happens before its later work."""
        _join(self.launch(agent), snapshot)

    def host_waits(self, snapshot: Mapping[str, int]) -> None:
        """The host blocked until an event completed."""
        _join(self._clocks[HOST_AGENT], snapshot)

    def host_waits_all(self) -> None:
        """The host blocked until every stream was idle."""
        host = self._clocks[HOST_AGENT]
        for agent, clock in self._clocks.items():
            if agent != HOST_AGENT:
                _join(host, clock)

    def host_waits_for(self, agent: str) -> None:
        """The host blocked until ``agent``'s work so far completed (a synchronous copy or value read)."""
        _join(self._clocks[HOST_AGENT], self._clocks[agent])

    def forget(self, key: int) -> None:
        """A storage was (re)registered or collected: its old accesses say nothing about the new memory."""
        self._history.pop(key, None)

    def copy_history(self, source: int, target: int) -> None:
        """``target`` (a storage or a cached block) also carries ``source``'s accesses: a block handed to a new
        user keeps what its earlier users did to it, so an unordered reuse is a race."""
        earlier = self._history.get(source)
        if earlier:
            self._history.setdefault(target, []).extend(earlier)

    # -- accesses -------------------------------------------------------------
    def access(self, agent: str, requests: Iterable[AccessRequest], op: str) -> None:
        """Issue one operation of ``agent`` touching ``requests``; report it if it races with history."""
        clock = self.launch(agent)
        clock[agent] += 1
        time = clock[agent]
        requests = list(requests)
        # Each earlier access is reported once per op, even when the op both reads and writes its bytes.
        conflicts: dict[int, str] = {}
        for request in sorted(requests, key=lambda request: not request.is_write):
            for earlier in self._history.get(request.key, ()):
                if id(earlier) not in conflicts and _races(earlier, agent, clock, request):
                    conflicts[id(earlier)] = _describe(earlier, agent, request, op)
        found = list(conflicts.values())
        if found:
            self.races.extend(found)
            if self.on_race == "raise":
                more = f" (and {len(found) - 1} more unordered pair(s))" if len(found) > 1 else ""
                raise SimRaceError(found[0] + more)
        for request in requests:
            self._record(request, _Access(request.lo, request.hi, agent, time, request.is_write, op), clock)

    def _record(self, request: AccessRequest, access: _Access, clock: VectorClock) -> None:
        """Append ``access``, dropping entries it subsumes so that histories stay short.

        An earlier entry covered by the new one and ordered before it can go when
        the new one is a write, or both are reads: anything that would race with
        the dropped entry but not with the new one is ordered after it anyway.
        """
        history = self._history.setdefault(request.key, [])
        history[:] = [
            earlier
            for earlier in history
            if not (
                earlier.lo >= access.lo
                and earlier.hi <= access.hi
                and (access.is_write or not earlier.is_write)
                and clock.get(earlier.agent, 0) >= earlier.time
            )
        ]
        history.append(access)


def _join(clock: VectorClock, other: Mapping[str, int]) -> None:
    for agent, time in other.items():
        if clock.get(agent, 0) < time:
            clock[agent] = time


def _races(earlier: _Access, agent: str, clock: VectorClock, request: AccessRequest) -> bool:
    return (
        earlier.agent != agent
        and (earlier.is_write or request.is_write)
        and earlier.lo < request.hi
        and request.lo < earlier.hi
        and clock.get(earlier.agent, 0) < earlier.time
    )


def _describe(earlier: _Access, agent: str, request: AccessRequest, op: str) -> str:
    lo, hi = max(earlier.lo, request.lo), min(earlier.hi, request.hi)
    if agent == HOST_AGENT:
        fix = f"the host must synchronize an event recorded on {earlier.agent} after the {earlier.op}"
    else:
        fix = f"{agent} must wait_event on an event recorded on {earlier.agent} after the {earlier.op}"
    return (
        f"Race on {request.memory} memory (storage {request.key:#x}, bytes [{lo}, {hi})): "
        f"{_verb(earlier.is_write)} by {earlier.agent} ({earlier.op}) and {_verb(request.is_write)} by {agent} "
        f"({op}) are not ordered: before the {op}, {fix}."
    )


def _verb(is_write: bool) -> str:
    return "write" if is_write else "read"
