"""Public home of the simulated accelerator (implemented in :mod:`swap_core.backends.sim`)."""

from __future__ import annotations

from swap_core.backends.sim import (
    SIM_MODES,
    CopyStats,
    MemoryKind,
    OnRace,
    SimBackend,
    SimEvent,
    SimMode,
    SimStream,
)

__all__ = ["SIM_MODES", "CopyStats", "MemoryKind", "OnRace", "SimBackend", "SimEvent", "SimMode", "SimStream"]
