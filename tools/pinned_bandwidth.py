"""Host-to-device and device-to-host bandwidth of exact-size pinned buffers against torch's pinned allocator.

For a lent GPU machine (``tools/device-check.sh`` runs it): both kinds of buffer must move data equally
fast, since exact pinning only changes how much host memory is locked. Exits 1 when an exact buffer is
more than 5% slower in either direction::

    python tools/pinned_bandwidth.py --backend cuda [--mib 256] [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from swap_core.backends.accelerator import AcceleratorBackend
from swap_core.backends.host_memory import HostMemoryMode

TOLERANCE = 0.95


def bandwidth(backend: AcceleratorBackend, mode: HostMemoryMode, nbytes: int, repeats: int) -> tuple[float, float]:
    """Median GB/s host-to-device and device-to-host through a buffer of ``mode``, timed with device events."""
    host = backend.empty_host(nbytes, torch.uint8, mode=mode)
    device = backend.empty((nbytes,), torch.uint8)
    stream = backend.new_stream()
    backend.wait_event(stream, backend.record_event(backend.compute_stream()))
    rates: dict[str, list[float]] = {"h2d": [], "d2h": []}
    for _ in range(repeats):
        for direction, (dst, src) in {"h2d": (device, host), "d2h": (host, device)}.items():
            start = backend.record_event(stream, timing=True)
            backend.copy(dst, src, stream=stream)
            end = backend.record_event(stream, timing=True)
            end.synchronize()
            rates[direction].append(nbytes / backend.elapsed_seconds(start, end) / 1e9)
    return statistics.median(rates["h2d"]), statistics.median(rates["d2h"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--backend", default="cuda", help="device type (cuda; npu and xpu pin through the caching path)"
    )
    parser.add_argument("--mib", type=int, default=256, help="buffer size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=10, help="timed copies per direction (default 10)")
    args = parser.parse_args()
    if args.backend == "sim":
        print("pinned bandwidth: nothing to measure on the simulator (it has no link); skipped")
        return 0
    backend = AcceleratorBackend(args.backend)
    nbytes = args.mib << 20
    results = {mode: bandwidth(backend, mode, nbytes, args.repeats) for mode in ("caching", "exact")}
    for mode, (h2d, d2h) in results.items():
        print(f"{mode:>8}: H2D {h2d:6.1f} GB/s   D2H {d2h:6.1f} GB/s   ({args.mib} MiB, median of {args.repeats})")
    ratios = [exact / caching for exact, caching in zip(results["exact"], results["caching"], strict=True)]
    print(f"exact / caching: H2D {ratios[0]:.3f}, D2H {ratios[1]:.3f} (required >= {TOLERANCE})")
    return 0 if min(ratios) >= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
