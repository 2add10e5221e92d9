"""Read-only views that tests take of a :class:`~swap_core.SwapOptimizer`: the batches it steps (re-exported from
:mod:`swap_core.views`, where benchmarks take them) and the simulator it runs on.

Suites assert exact copies and bytes against the batches a step runs, and drive the
simulator's fault and copy counters. They read both through these two functions, never
through the optimizer's private plan or a ``type: ignore`` on a backend annotation::

    from swap_core.testing.views import planned_batches, simulator_of

    batches = planned_batches(opt)                  # what the next step moves, batch by batch
    sim = simulator_of(opt)                         # the SimBackend it runs on (TypeError otherwise)
    sim.reset_copy_stats()
    opt.step()
    assert sim.copy_stats.h2d_copies == sum(len(batch.copy_bytes) for batch in batches)
"""

from __future__ import annotations

from ..backends.protocol import DeviceBackend
from ..backends.sim import SimBackend
from ..optimizer import SwapOptimizer
from ..views import BatchView, PlannedState, planned_batches, planned_resident_params

__all__ = ["BatchView", "PlannedState", "planned_batches", "planned_resident_params", "simulator_of"]


def simulator_of(target: SwapOptimizer | DeviceBackend | None) -> SimBackend:
    """The :class:`~swap_core.sim.SimBackend` behind ``target`` (an optimizer or a backend).

    Raises ``TypeError`` naming what ``target`` runs on when it is not the simulator: counters
    of copies, injected copy faults and the race checker exist only there.
    """
    backend = target.backend if isinstance(target, SwapOptimizer) else target
    if not isinstance(backend, SimBackend):
        name = "no backend (CPU parameters, nothing swapped)" if backend is None else type(backend).__name__
        raise TypeError(
            f"This check needs the simulated accelerator, but it runs on {name}; "
            "build the optimizer with SwapConfig(backend=SimBackend(...)) or run the suite with --backend sim"
        )
    return backend
