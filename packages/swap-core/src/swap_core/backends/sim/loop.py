"""A training loop on the simulator's virtual clock: what a step costs the loop, not only itself.

A step's own modeled seconds cannot show a host that waits needlessly: a step that blocks the host until its
last copy-out has landed ends, on the compute stream, exactly when one that does not ends. The loop shows it:
the host launches the next forward only after the step returns, so a host wait inside the step delays the next
forward on the compute stream. :func:`modeled_iterations` runs ``iterations`` rounds of a modeled forward and
backward (``SimBackend.model_compute``), the host reading the loss (``model_host_read``, as ``loss.item()``
does, optional) and the real ``step()``, and returns the time from each forward's start to the next one's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from .backend import SimBackend

__all__ = ["modeled_iterations"]


def modeled_iterations(
    backend: SimBackend,
    step: Callable[[], object],
    *,
    forward_backward_seconds: float,
    iterations: int = 3,
    read_loss: bool = True,
    backward: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds of each of ``iterations`` training iterations on ``backend``'s virtual clock.

    Each iteration is a forward and backward of ``forward_backward_seconds`` on the current stream, launched
    by the host as soon as it gets there; then (``read_loss``) the host waits for it, as ``loss.item()`` makes
    it wait; then ``step()`` (set the gradients and call the optimizer's ``step`` in it). An iteration lasts
    from its forward's start to the next forward's start: with a host that never waits for the step's copies,
    the forward and backward plus the step's time on the compute stream.

    ``backward``: a real backward, run after the modeled ``forward_backward_seconds`` (then only the forward's
    time, or what the backward does not model itself) and before the loss is read: an autograd backward whose
    nodes model their compute, so that gradient hooks (``SwapConfig(step="in_backward")``) run inside it.
    """
    times = backend.modeled_times()
    if times is None:
        raise ValueError("modeled_iterations needs a virtual clock: SimBackend(timing=LinkModel(...))")
    if iterations < 1:
        raise ValueError(f"modeled_iterations needs iterations >= 1, got {iterations!r}")
    starts: list[float] = []
    for _ in range(iterations + 1):
        times = backend.modeled_times()
        assert times is not None
        starts.append(max(times.host, times.compute))  # the forward starts once launched and its stream is free
        if len(starts) > iterations:
            break
        backend.model_compute(forward_backward_seconds)
        if backward is not None:
            backward()
        if read_loss:
            backend.model_host_read()
        step()
    return [later - earlier for earlier, later in itertools.pairwise(starts)]
