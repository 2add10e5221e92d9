"""The simulated accelerator: stream semantics of a real device over CPU memory, with ordering checks.

See :class:`SimBackend`. Public names are re-exported as :mod:`swap_core.sim`.
"""

from __future__ import annotations

from .backend import SIM_MODES, SimBackend, SimMode
from .copy_stats import CopyStats
from .memory import MemoryKind
from .race_checker import OnRace
from .streams import SimEvent, SimStream

__all__ = ["SIM_MODES", "CopyStats", "MemoryKind", "OnRace", "SimBackend", "SimEvent", "SimMode", "SimStream"]
