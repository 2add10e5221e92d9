"""Host<->device bandwidth of exact-size pinned buffers against torch's pinned allocator and pageable memory.

For a lent GPU machine (``tools/device-check.sh part2`` runs it): exact and caching buffers must move data
equally fast, since exact pinning only changes how much host memory is locked; the pageable row is the
baseline both must beat. Every measured buffer is checked to be what it claims (``is_pinned()``), and a
fallback of the backend (its ``PinnedMemoryWarning``) is an error here, not a quietly slower row. The
machine's facts (page size, memlock limit, driver and CUDA versions, GPU topology, torch) are printed
beside the figures and written with them to a JSON file. Exits 1 when an exact buffer is more than 5%
slower than a caching one in either direction::

    python tools/pinned_bandwidth.py --backend cuda [--mib 256] [--repeats 10] [--json PATH]

``--json`` defaults to ``$OUT/pinned-bandwidth.json`` (the lending tool's output folder), else
``out/device-check/pinned-bandwidth.json``. With ``--backend sim`` only the facts are written.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Literal

import torch

from swap_core.backends.accelerator import AcceleratorBackend
from swap_core.backends.host_registration import host_registrar
from swap_core.errors import PinnedMemoryWarning

TOLERANCE = 0.95

BufferKind = Literal["exact", "caching", "pageable"]
KINDS: tuple[BufferKind, ...] = ("exact", "caching", "pageable")


def host_buffer(backend: AcceleratorBackend, kind: BufferKind, nbytes: int) -> torch.Tensor:
    """A host buffer of ``kind``, checked to be pinned (exact, caching) or not (pageable)."""
    if kind == "pageable":
        buffer = torch.empty(nbytes, dtype=torch.uint8)
    else:
        buffer = backend.empty_host(nbytes, torch.uint8, mode=kind)
    pinned = buffer.is_pinned()
    if pinned != (kind != "pageable"):
        raise RuntimeError(f"the {kind} buffer of {nbytes} bytes reports is_pinned() = {pinned}")
    return buffer


def bandwidth(backend: AcceleratorBackend, host: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Median GB/s host-to-device and device-to-host through ``host``, timed with device events."""
    nbytes = host.numel()
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


def machine_facts(backend_name: str) -> dict[str, object]:
    """What the figures depend on: page size, memlock limit, driver and CUDA versions, topology, torch."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    facts: dict[str, object] = {
        "backend": backend_name,
        "host": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "page_bytes": mmap.PAGESIZE,
        "memlock_limit_bytes": {"soft": _limit(soft), "hard": _limit(hard)},
    }
    if backend_name == "cuda" and torch.cuda.is_available():
        facts["devices"] = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        summary = _run([smi])
        driver = _run([smi, "--query-gpu=driver_version", "--format=csv,noheader"])
        facts["driver"] = driver.splitlines()[0].strip() if driver else None
        found = re.search(r"CUDA Version:\s*([\d.]+)", summary or "")
        facts["driver_cuda"] = found.group(1) if found else None
        facts["topology"] = _run([smi, "topo", "-m"])
    return facts


def _limit(value: int) -> int | str:
    return "unlimited" if value == resource.RLIM_INFINITY else value


def _run(command: list[str]) -> str | None:
    """``command``'s standard output, or ``None`` when it fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.rstrip()


def print_facts(facts: dict[str, object]) -> None:
    for key, value in facts.items():
        if key == "topology":
            continue
        print(f"{key:>20}: {value}")
    if facts.get("topology"):
        print("nvidia-smi topo -m:")
        print(facts["topology"])


def default_json_path() -> Path:
    return Path(os.environ.get("OUT") or "out/device-check") / "pinned-bandwidth.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--backend", default="cuda", help="device type (cuda; npu and xpu pin through the caching path)"
    )
    parser.add_argument("--mib", type=int, default=256, help="buffer size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=10, help="timed copies per direction (default 10)")
    parser.add_argument("--json", type=Path, default=None, help="where to write the facts and figures")
    args = parser.parse_args()
    facts = machine_facts(args.backend)
    print_facts(facts)
    report: dict[str, object] = {"facts": facts}
    json_path: Path = args.json or default_json_path()
    if args.backend == "sim":
        print("pinned bandwidth: nothing to measure on the simulator (it has no link); facts only")
        write_report(report, json_path)
        return 0
    try:
        return measure(args.backend, args.mib, args.repeats, report)
    except Exception as error:
        report["error"] = f"{type(error).__name__}: {error}"
        raise
    finally:  # the facts are worth keeping when the measurement fails
        write_report(report, json_path)


def write_report(report: dict[str, object], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {path}")


def measure(backend_name: str, mib: int, repeats: int, report: dict[str, object]) -> int:
    """Time every kind of buffer into ``report``; 1 when exact buffers are slower than caching ones.

    Where the device's runtime has no public way to register host memory (xpu), exact buffers are the caching
    ones by design: that row is left out. Any other fallback raises.
    """
    warnings.simplefilter("error", PinnedMemoryWarning)  # a fallback would measure another kind of buffer
    backend = AcceleratorBackend(backend_name)
    kinds = [kind for kind in KINDS if kind != "exact" or host_registrar(backend_name) is not None]
    if "exact" not in kinds:
        print(f"exact: {backend_name} has no way to register host memory; its exact buffers are caching ones")
    nbytes = mib << 20
    results = {kind: bandwidth(backend, host_buffer(backend, kind, nbytes), repeats) for kind in kinds}
    for kind, (h2d, d2h) in results.items():
        print(f"{kind:>8}: H2D {h2d:6.1f} GB/s   D2H {d2h:6.1f} GB/s   ({mib} MiB, median of {repeats})")
    report["bandwidth_gb_s"] = {kind: {"h2d": h2d, "d2h": d2h} for kind, (h2d, d2h) in results.items()}
    report["buffer_mib"] = mib
    report["repeats"] = repeats
    if "exact" not in results:
        return 0
    ratios = [exact / caching for exact, caching in zip(results["exact"], results["caching"], strict=True)]
    print(f"exact / caching: H2D {ratios[0]:.3f}, D2H {ratios[1]:.3f} (required >= {TOLERANCE})")
    report["exact_over_caching"] = {"h2d": ratios[0], "d2h": ratios[1], "required": TOLERANCE}
    return 0 if min(ratios) >= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
