"""Per-step timelines of the swap pipeline, exportable as Chrome / Perfetto trace JSON.

With ``SwapConfig(trace=True)`` every step records, per batch, when its
host-to-device copy, its update and its device-to-host copy ran: device events
on real accelerators, the simulator's clock on ``SimBackend`` (faithful in its
``sync`` mode, where work runs when issued). Tracing makes the end of ``step()``
wait for the device, so leave it off outside of measurements.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .adapters.base import RESIDENT_BATCH_INDEX

__all__ = ["PHASES", "StepTrace", "TraceInterval"]

PHASES = ("h2d", "update", "d2h")
"""Pipeline phases, each on its own lane (stream) of the timeline."""


@dataclasses.dataclass(frozen=True)
class TraceInterval:
    """One phase of one batch, in seconds from the start of the step."""

    batch: int
    """The batch's index in the step, or ``-1`` for the update of the resident parameters (no swapped state)."""
    phase: str
    start: float
    end: float
    nbytes: int = 0
    """Bytes copied (0 for updates)."""

    @property
    def label(self) -> str:
        """``"b3"`` for batch 3, ``"resident"`` for the resident parameters' update."""
        return "resident" if self.batch == RESIDENT_BATCH_INDEX else f"b{self.batch}"

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclasses.dataclass
class StepTrace:
    """The pipeline timeline of one ``step()``."""

    intervals: list[TraceInterval] = dataclasses.field(default_factory=list)

    def __iter__(self) -> Iterator[TraceInterval]:
        return iter(self.intervals)

    @property
    def seconds(self) -> float:
        """From the step's start to the end of its last phase."""
        return max((interval.end for interval in self.intervals), default=0.0)

    def to_chrome_trace(self, *, step: int = 0, offset_seconds: float = 0.0) -> dict[str, Any]:
        """The ``{"traceEvents": [...]}`` document chrome://tracing and ui.perfetto.dev open."""
        events: list[dict[str, Any]] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": lane, "args": {"name": phase}}
            for lane, phase in enumerate(PHASES)
        ]
        for interval in self.intervals:
            events.append(
                {
                    "name": f"{interval.phase} {interval.label}",
                    "cat": "swap",
                    "ph": "X",
                    "pid": 0,
                    "tid": PHASES.index(interval.phase),
                    "ts": (offset_seconds + interval.start) * 1e6,
                    "dur": interval.seconds * 1e6,
                    "args": {"step": step, "batch": interval.batch, "bytes": interval.nbytes},
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save(self, path: str | Path) -> Path:
        """Write :meth:`to_chrome_trace` as JSON to ``path``."""
        target = Path(path)
        target.write_text(json.dumps(self.to_chrome_trace()))
        return target
