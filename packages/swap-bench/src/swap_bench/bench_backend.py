"""The device a swap-bench measurement runs on: a real accelerator, or the simulator on a CPU."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from swap_core import DeviceBackend
from swap_core.backends.accelerator import accelerator_available

__all__ = ["BackendChoice", "bench_backend", "refuse_a_missing_accelerator"]

BackendChoice = tuple[str, str, Callable[[], DeviceBackend]]
"""The backend's name (``"sim"``, ``"cuda"``...), how it is set up (for the report), and a factory of it."""


def bench_backend(name: str) -> BackendChoice:
    """A real accelerator when asked for or present (``auto``), else the simulator: in ``sync`` mode without checks
    or poison, so that it adds nothing per op and timings mean host cost."""
    if name == "auto":
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        name = accelerator.type if accelerator is not None else "sim"
    if name == "sim":
        from swap_core.sim import SimBackend

        return (
            "sim",
            "SimBackend(mode='sync', check_races=False, poison=False)",
            lambda: SimBackend(mode="sync", check_races=False, poison=False),
        )
    from swap_core.backends.accelerator import AcceleratorBackend

    return name, f"AcceleratorBackend({name!r})", lambda: AcceleratorBackend(name)


def refuse_a_missing_accelerator(parser: argparse.ArgumentParser, name: str) -> None:
    """An ``error:`` line (exit status 2) for ``--backend cuda`` (npu, xpu) where torch has no such device."""
    if name not in ("auto", "sim") and not accelerator_available(name):
        parser.error(
            f"--backend {name}: torch {torch.__version__} has no usable {name} device here (use --backend sim, or auto)"
        )
