"""External offloading baselines for AdamW: torchao's ``CPUOffloadOptimizer`` and DeepSpeed's ``DeepSpeedCPUAdam``.

Both keep AdamW's state in host memory and compute the update on the host CPU (swap computes it on the
device). They are comparison rows only: CUDA only, AdamW only, and never required. A baseline whose
package is not installed, or a backend other than CUDA, gives a skipped row with the reason. Neither
baseline has been run on hardware in this project yet (no CUDA device and neither package where it was
written); the measuring logic is tested on the simulator with stand-ins.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from swap_core import DeviceBackend

from .measure import BaselineFactory, BaselineOptimizer
from .workloads import ADAMW_KWARGS, Workload

__all__ = ["BASELINES", "Baseline", "ComparisonConfig", "HostMasterOffload", "plan_comparisons"]

HostOptimizerFactory = Callable[[list[torch.Tensor]], BaselineOptimizer]
"""Builds the optimizer that updates the host master parameters (DeepSpeedCPUAdam, or a stand-in in tests)."""


class HostMasterOffload:
    """ZeRO-Offload's optimizer step for parameters on one device: masters and their optimizer in host memory.

    Construction copies every parameter into a pinned host master. :meth:`step`, on one copy stream: waits
    for the compute stream (the backward that wrote the gradients), copies every gradient into a pinned host
    buffer, blocks the host until they have arrived, runs the host optimizer on the masters, copies every
    master back into its device parameter, and makes the compute stream wait for those copies. The copies
    are not overlapped with the backward pass as DeepSpeed's ``overlap_comm`` would: this is the serialized
    sequence. Float32 parameters only (ZeRO-Offload keeps float32 masters).
    """

    def __init__(
        self, params: Sequence[torch.nn.Parameter], backend: DeviceBackend, host_optimizer: HostOptimizerFactory
    ) -> None:
        for param in params:
            if param.dtype != torch.float32:
                raise ValueError(f"HostMasterOffload takes float32 parameters only, got one of {param.dtype}")
        self._backend = backend
        self._compute = backend.compute_stream()
        self._copy_stream = backend.new_stream()
        self._params = list(params)
        self._masters = [backend.empty_host(p.numel(), p.dtype).view(p.shape) for p in self._params]
        self._host_grads = [backend.empty_host(p.numel(), p.dtype).view(p.shape) for p in self._params]
        backend.wait_event(self._copy_stream, backend.record_event(self._compute))
        for master, param in zip(self._masters, self._params, strict=True):
            backend.copy(master, param.detach(), stream=self._copy_stream)
        backend.record_event(self._copy_stream).synchronize()
        self._host_optimizer = host_optimizer(self._masters)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the device gradients; the host buffers are overwritten by the next step."""
        for param in self._params:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        backend = self._backend
        backend.wait_event(self._copy_stream, backend.record_event(self._compute))
        for param, master, host_grad in zip(self._params, self._masters, self._host_grads, strict=True):
            # A parameter without a gradient is skipped by the host optimizer, as by torch's.
            master.grad = None if param.grad is None else host_grad
            if param.grad is not None:
                backend.copy(host_grad, param.grad, stream=self._copy_stream)
        backend.record_event(self._copy_stream).synchronize()
        self._host_optimizer.step()
        for param, master in zip(self._params, self._masters, strict=True):
            backend.copy(param.detach(), master, stream=self._copy_stream)
        backend.wait_event(self._compute, backend.record_event(self._copy_stream))


@dataclasses.dataclass(frozen=True)
class Baseline:
    """An external AdamW that keeps its state in host memory, measured against plain on-device AdamW."""

    name: str
    """The ``--compare`` name and the ``baseline`` field of its rows."""
    package: str
    """The import name that must be installed for its rows to run."""
    build: BaselineFactory
    """Builds it over the device parameters (imports the package)."""
    float32_only: bool = False
    """Whether it updates float32 parameters only."""


@dataclasses.dataclass(frozen=True)
class ComparisonConfig:
    """One comparison row to measure: a workload under plain AdamW and under a baseline."""

    workload: Workload
    baseline: Baseline

    @property
    def label(self) -> str:
        return _label(self.workload, self.baseline.name)


def _label(workload: Workload, baseline: str) -> str:
    return f"{workload.name} adamw vs {baseline}"


def _build_torchao(params: list[torch.nn.Parameter], backend: DeviceBackend) -> BaselineOptimizer:
    """``CPUOffloadOptimizer(params, torch.optim.AdamW, **ADAMW_KWARGS)`` with torchao's own defaults.

    Per torchao's source when this was written: the host AdamW is torch's fused CPU kernel, gradients are
    copied to pinned host memory by a hook as each one is accumulated, and parameters under 4,096 elements
    stay on the device with an on-device AdamW. It finds its device itself (the last available one).
    """
    cpu_offload_optimizer = _torchao_cpu_offload_optimizer()
    optimizer: BaselineOptimizer = cpu_offload_optimizer(params, torch.optim.AdamW, **ADAMW_KWARGS)
    return optimizer


def _torchao_cpu_offload_optimizer() -> Any:
    """``torchao.optim.CPUOffloadOptimizer``; older torchao releases have it in ``torchao.prototype.low_bit_optim``."""
    try:
        found = getattr(importlib.import_module("torchao.optim"), "CPUOffloadOptimizer", None)
    except ImportError:
        found = None
    if found is not None:
        return found
    return importlib.import_module("torchao.prototype.low_bit_optim").CPUOffloadOptimizer


def _build_deepspeed(params: list[torch.nn.Parameter], backend: DeviceBackend) -> BaselineOptimizer:
    """:class:`HostMasterOffload` stepping ``DeepSpeedCPUAdam(masters, adamw_mode=True, **ADAMW_KWARGS)``."""
    cpu_adam = importlib.import_module("deepspeed.ops.adam").DeepSpeedCPUAdam

    def host_optimizer(masters: list[torch.Tensor]) -> BaselineOptimizer:
        optimizer: BaselineOptimizer = cpu_adam(masters, adamw_mode=True, **ADAMW_KWARGS)
        return optimizer

    return HostMasterOffload(params, backend, host_optimizer)


BASELINES: dict[str, Baseline] = {
    "torchao": Baseline("torchao", "torchao", _build_torchao),
    "deepspeed": Baseline("deepspeed", "deepspeed", _build_deepspeed, float32_only=True),
}
"""The baselines ``--compare`` can name."""


def _is_installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def plan_comparisons(
    workloads: Sequence[Workload],
    baselines: Sequence[str],
    *,
    backend_name: str,
    installed: Callable[[str], bool] = _is_installed,
) -> tuple[list[ComparisonConfig], list[dict[str, str]]]:
    """One comparison row per workload and baseline; the rows that cannot run here are returned with the reason."""
    rows: list[ComparisonConfig] = []
    skipped: list[dict[str, str]] = []
    for workload, name in itertools.product(workloads, baselines):
        baseline = BASELINES[name]
        reason = _skip_reason(workload, baseline, backend_name, installed)
        if reason is None:
            rows.append(ComparisonConfig(workload, baseline))
        else:
            skipped.append({"row": _label(workload, name), "reason": reason})
    return rows, skipped


def _skip_reason(
    workload: Workload, baseline: Baseline, backend_name: str, installed: Callable[[str], bool]
) -> str | None:
    if backend_name != "cuda":
        return f"needs a CUDA device (backend: {backend_name})"
    if not installed(baseline.package):
        return f"{baseline.package} not installed"
    other_dtypes = sorted({str(dtype) for _, dtype in workload.tensors if dtype != torch.float32})
    if baseline.float32_only and other_dtypes:
        return f"{baseline.name} updates float32 parameters only; this workload has {', '.join(other_dtypes)}"
    return None
