"""Raw pinned-copy bandwidth of the backend, measured in the same run as the steps it explains."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from swap_core import DeviceBackend

__all__ = ["LinkBandwidth", "measure_link"]


@dataclasses.dataclass(frozen=True)
class LinkBandwidth:
    """Bytes per second host-to-device, device-to-host, and both directions at once (two streams)."""

    h2d: float
    d2h: float
    duplex: float
    nbytes: int


def measure_link(backend: DeviceBackend, nbytes: int, repeats: int = 5) -> LinkBandwidth:
    """Median bandwidth of ``nbytes`` copies between pinned host memory and the device."""
    numel = max(nbytes // 4, 1)
    host_in = backend.empty_host(numel, torch.float32)
    host_out = backend.empty_host(numel, torch.float32)
    device_in = backend.empty((numel,), torch.float32)
    device_out = backend.empty((numel,), torch.float32)
    h2d, d2h = backend.new_stream(), backend.new_stream()
    host_in.fill_(1.0)
    backend.synchronize()

    def timed(*copies: tuple[torch.Tensor, torch.Tensor, object]) -> float:
        samples = []
        for _ in range(repeats):
            backend.synchronize()
            started = time.perf_counter()
            for dst, src, stream in copies:
                backend.copy(dst, src, stream=stream)
            backend.synchronize()
            samples.append(time.perf_counter() - started)
        return statistics.median(samples)

    size = numel * 4
    h2d_seconds = timed((device_in, host_in, h2d))
    d2h_seconds = timed((host_out, device_out, d2h))
    both_seconds = timed((device_in, host_in, h2d), (host_out, device_out, d2h))
    for tensor in (device_in, device_out):
        backend.release_storage(tensor)
    return LinkBandwidth(size / h2d_seconds, size / d2h_seconds, 2 * size / both_seconds, size)
