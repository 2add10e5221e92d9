"""What a measurement on a device depends on, read without touching the device: the GPU, its driver, torch, the
host link's generation and width (PCIe, or NVLink-C2C on Grace machines), and which NUMA node the GPU hangs off.

Read from ``nvidia-smi`` and ``/sys`` in the process that runs the rows (which never initializes the device itself,
so that the rows' processes find all of its memory free). Each figure is ``None`` where it cannot be read (no
``nvidia-smi``, another vendor's device, the simulator). The link's generation is read as the driver reports it at
that moment: a GPU may lower its PCIe speed while idle, so ``pcie_generation_max`` (what the link negotiates at
most) is read too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .report import machine_facts

__all__ = ["GPU_QUERY_FIELDS", "CommandRunner", "device_facts", "run_command"]

CommandRunner = Callable[[Sequence[str]], str | None]
"""Runs a command and returns its standard output, or ``None`` when it cannot be run or fails."""

GPU_QUERY_FIELDS = {
    "gpu": "name",
    "driver": "driver_version",
    "gpu_memory_mib": "memory.total",
    "pci_bus_id": "pci.bus_id",
    "pcie_generation": "pcie.link.gen.current",
    "pcie_generation_max": "pcie.link.gen.max",
    "pcie_width": "pcie.link.width.current",
    "pcie_width_max": "pcie.link.width.max",
}
"""Our name for each figure, and the ``nvidia-smi --query-gpu`` field it is read from (one query per field: a
driver that lacks one field fails the whole query)."""


def run_command(command: Sequence[str]) -> str | None:
    """``command``'s standard output, stripped, or ``None`` when it cannot be run, fails or takes over 30 s."""
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def device_facts(
    backend: str, *, run: CommandRunner = run_command, sysfs: Path = Path("/sys"), smi: str | None = None
) -> dict[str, object]:
    """The machine's facts for a report of ``backend``'s rows (``smi``: the ``nvidia-smi`` to ask, found on the
    ``PATH`` by default; ``run`` and ``sysfs`` are replaced in tests)."""
    facts: dict[str, object] = {
        **machine_facts(),
        "backend": backend,
        "cpus": os.cpu_count(),
        "torch_cuda": torch.version.cuda,
        "numa_nodes": _numa_nodes(sysfs),
    }
    smi = smi if smi is not None else shutil.which("nvidia-smi")
    gpu: dict[str, str | None] = dict.fromkeys(GPU_QUERY_FIELDS)
    if smi is not None:
        for key, field in GPU_QUERY_FIELDS.items():
            gpu[key] = _first_line(run([smi, f"--query-gpu={field}", "--format=csv,noheader,nounits"]))
        summary = run([smi]) or ""
        found = re.search(r"CUDA Version:\s*([\d.]+)", summary)
        facts["driver_cuda"] = found.group(1) if found else None
        facts["nvlink_c2c"] = _c2c(run([smi, "c2c", "-s"]))
        facts["topology"] = run([smi, "topo", "-m"])
    facts.update(gpu)
    facts["gpu_numa_node"] = _gpu_numa_node(gpu["pci_bus_id"], sysfs)
    facts["link"] = _link_summary(gpu, facts.get("nvlink_c2c"))
    return facts


def _first_line(output: str | None) -> str | None:
    """The first GPU's value (one line per GPU), or ``None`` for an empty or unsupported one."""
    if not output:
        return None
    value = output.splitlines()[0].strip()
    return None if value in ("", "[N/A]", "N/A") or value.startswith("[Not Supported]") else value


def _c2c(output: str | None) -> str | None:
    """``nvidia-smi c2c -s`` where it reports NVLink-C2C links (Grace Hopper, Grace Blackwell), else ``None``."""
    if not output or "not supported" in output.lower() or not re.search(r"C2C Link \d+", output):
        return None
    return output


def _gpu_numa_node(bus_id: str | None, sysfs: Path) -> int | None:
    """The NUMA node of the GPU's PCI device (``nvidia-smi``'s bus id ``00000000:18:00.0`` is sysfs'
    ``0000:18:00.0``); ``None`` where it cannot be read or the kernel does not know it (``-1``)."""
    if bus_id is None:
        return None
    domain, _, rest = bus_id.lower().partition(":")
    try:
        node = int((sysfs / "bus" / "pci" / "devices" / f"{domain[-4:]}:{rest}" / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _numa_nodes(sysfs: Path) -> int | None:
    nodes = [path for path in (sysfs / "devices" / "system" / "node").glob("node*") if path.name[4:].isdigit()]
    return len(nodes) or None


def _link_summary(gpu: dict[str, str | None], c2c: object) -> str | None:
    """``"PCIe 5.0 x16 (at most 5.0 x16)"``, ``"NVLink-C2C"``, or ``None`` when neither could be read."""
    if c2c is not None:
        return "NVLink-C2C"
    generation, width = gpu["pcie_generation"], gpu["pcie_width"]
    if generation is None:
        return None
    summary = f"PCIe {generation}.0" + (f" x{width}" if width else "")
    if gpu["pcie_generation_max"] is not None:
        summary += f" (at most {gpu['pcie_generation_max']}.0 x{gpu['pcie_width_max'] or '?'})"
    return summary
