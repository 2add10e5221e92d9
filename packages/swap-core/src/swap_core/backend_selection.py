"""Turn ``SwapConfig.backend`` into a device backend for a set of parameters.

This is policy, so it lives above ``backends/``: nothing below imports it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch

from .backends.protocol import DeviceBackend
from .config import BackendSpec

__all__ = ["select_backend"]


def select_backend(
    spec: BackendSpec, params: Iterable[torch.Tensor], *, master_weights: bool = False
) -> DeviceBackend | None:
    """The backend that swaps states of ``params``, or ``None`` when nothing should be swapped.

    ``"auto"`` follows the parameters: an accelerator device gets that
    accelerator's backend; CPU parameters get no swapping at all (the wrapped
    optimizer runs unchanged, with the same results), or, with ``master_weights``, a
    :class:`~swap_core.backends.cpu.CpuBackend`: the runtime runs the master math on the
    CPU, with nothing swapped. Without parameters (an optimizer whose groups come later), a
    backend given or named (``"cuda"``...) is taken as it is; ``add_param_group`` checks the
    parameters it brings.
    """
    devices = _devices(params)
    if len(devices) > 1:
        raise ValueError(
            f"Parameters live on several devices {sorted(map(str, devices))}; swap one optimizer per device"
        )
    if not devices and spec not in ("auto", "sim"):  # no parameter yet: the backend named or given is taken
        return spec if not isinstance(spec, str) else _accelerator(spec, None)
    device = next(iter(devices), torch.device("cpu"))
    if not isinstance(spec, str):
        if not spec.owns(torch.empty(0, device=device)):
            raise ValueError(f"Backend {spec.name!r} does not own parameters on {device}")
        return spec
    if spec == "auto":
        return _auto_backend(device, has_params=bool(devices), master_weights=master_weights)
    if spec == "sim":
        if device.type != "cpu":
            raise ValueError(f"backend='sim' simulates an accelerator over CPU memory; parameters are on {device}")
        from .backends.sim import SimBackend

        return SimBackend()
    if device.type != spec:
        raise ValueError(f"backend={spec!r} but the parameters are on {device}; move the model there first")
    return _accelerator(spec, device.index)


def _auto_backend(device: torch.device, *, has_params: bool, master_weights: bool) -> DeviceBackend | None:
    """What ``backend="auto"`` picks for parameters on ``device``: that accelerator's backend; on the CPU, no
    swapping (said in a warning when there are parameters), or a ``CpuBackend`` with ``master_weights``."""
    if device.type != "cpu":
        return _accelerator(device.type, device.index)
    if not master_weights:
        if has_params:
            warnings.warn(
                "The parameters are on the CPU, so nothing is swapped: backend='auto' swaps the states of "
                "accelerator parameters, and the optimizer steps here as it would unwrapped (opt.stats stays "
                "at zero). To try swapping without an accelerator, use SwapConfig(backend='sim'), the simulated "
                "accelerator",
                UserWarning,
                stacklevel=5,  # past this function, select_backend, SwapOptimizer.__init__ and swap_optimizer
            )
        return None
    from .backends.cpu import CpuBackend

    return CpuBackend()


def _accelerator(device_type: str, index: int | None) -> DeviceBackend:
    from .backends.accelerator import AcceleratorBackend

    return AcceleratorBackend(device_type, index)


def _devices(params: Iterable[torch.Tensor]) -> set[torch.device]:
    devices = set()
    for param in params:
        device = param.device
        # DTensor parameters report the mesh's device; their local shards live there too.
        devices.add(torch.device(device.type, device.index) if device.type != "cpu" else torch.device("cpu"))
    return devices
