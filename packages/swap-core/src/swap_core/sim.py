"""Public home of the simulated accelerator (implemented in :mod:`swap_core.backends.sim`)."""

from __future__ import annotations

from swap_core.backends.meta import MetaBackend
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
from swap_core.backends.sim.loop import modeled_iterations
from swap_core.backends.sim.timing import LINK_PRESETS, LinkModel, ModeledTimes

__all__ = [
    "LINK_PRESETS",
    "SIM_MODES",
    "CopyStats",
    "LinkModel",
    "MemoryKind",
    "MetaBackend",
    "ModeledTimes",
    "OnRace",
    "SimBackend",
    "SimEvent",
    "SimMode",
    "SimStream",
    "modeled_iterations",
]
