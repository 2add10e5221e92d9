"""Host registration on CPU: the runtime registrars over fake ``cudart`` / ``npurt`` bindings, the device binding,
and the search for the CUDA runtime's ``cudaGetLastError`` (``swap_core.torch_compat``).

What only a device shows (the last error really reset, the guard really used) is in
``test_accelerator_backend.py``'s real-device tests (``--backend cuda|npu``).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

import pytest
import torch

from swap_core.backends.host_memory import PAGE_BYTES
from swap_core.backends.host_registration import (
    CudaHostRegistrar,
    DeviceBoundRegistrar,
    NpuHostRegistrar,
    registered_host_buffer,
)
from swap_core.torch_compat import TorchCompatError, clear_cuda_last_error, runtime_library_function


class StatusOnlyCudart:
    """A ``torch.cuda.cudart()`` that returns statuses and nothing else (no error strings, no ``cudaError``)."""

    def __init__(self, register_status: int = 0, unregister_status: int = 0) -> None:
        self.register_status = register_status
        self.unregister_status = unregister_status
        self.last_error = 0

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.last_error = self.register_status or self.last_error
        return self.register_status

    def cudaHostUnregister(self, address: int) -> int:
        self.last_error = self.unregister_status or self.last_error
        return self.unregister_status

    def get_last_error(self) -> int:
        error, self.last_error = self.last_error, 0
        return error


def test_an_error_the_binding_cannot_describe_is_shown_by_its_number() -> None:
    cudart = StatusOnlyCudart(register_status=9999)
    registrar = CudaHostRegistrar(cudart=lambda: cudart, clear_last_error=cudart.get_last_error)
    with pytest.raises(RuntimeError) as raised:
        registrar.register(PAGE_BYTES, 2 * PAGE_BYTES)
    assert str(raised.value) == f"cudaHostRegister({2 * PAGE_BYTES} bytes) failed with CUDA error 9999"
    assert cudart.last_error == 0


def test_a_failed_cuda_unregistration_resets_the_last_error_and_names_the_range() -> None:
    cudart = StatusOnlyCudart(unregister_status=1)
    registrar = CudaHostRegistrar(cudart=lambda: cudart, clear_last_error=cudart.get_last_error)
    with pytest.raises(RuntimeError, match=r"^cudaHostUnregister\(0x10000\) failed with CUDA error 1$"):
        registrar.unregister(0x10000)
    assert cudart.last_error == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has a CUDA runtime")
def test_a_torch_without_cuda_refuses_registration_with_a_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="the CUDA runtime is not available"):
        CudaHostRegistrar().register(PAGE_BYTES, PAGE_BYTES)


def test_npu_registration_failures_name_the_acl_error() -> None:
    class RefusingNpurt:
        def npuHostRegister(self, address: int, nbytes: int, flags: int) -> int:
            return 107000

        def npuHostUnregister(self, address: int) -> int:
            return 507911

    registrar = NpuHostRegistrar(RefusingNpurt)
    with pytest.raises(RuntimeError, match=rf"^npuHostRegister\({PAGE_BYTES} bytes\) failed with ACL error 107000$"):
        registrar.register(PAGE_BYTES, PAGE_BYTES)
    with pytest.raises(RuntimeError, match=r"^npuHostUnregister\(0x10000\) failed with ACL error 507911$"):
        registrar.unregister(0x10000)


def test_an_npu_runtime_that_cannot_start_is_a_refused_registration() -> None:
    def npurt() -> object:
        raise RuntimeError("npu runtime init failed (test)")

    with pytest.raises(RuntimeError, match=r"torch_npu's runtime bindings are not available \(npu runtime init"):
        NpuHostRegistrar(npurt).register(PAGE_BYTES, PAGE_BYTES)  # type: ignore[arg-type]


class GuardedDevice:
    """The device guard and synchronize of a device module, recording the order of everything."""

    def __init__(self) -> None:
        self.current = 0
        self.log: list[str] = []

    @contextlib.contextmanager
    def device(self, device: int) -> Iterator[None]:
        previous, self.current = self.current, device
        self.log.append(f"enter {device}")
        try:
            yield
        finally:
            self.current = previous
            self.log.append(f"leave {device}")

    def synchronize(self, device: torch.device) -> None:
        self.log.append(f"synchronize {device} on {self.current}")


class LoggingRuntime:
    def __init__(self, device: GuardedDevice, refuse: bool = False) -> None:
        self.device = device
        self.refuse = refuse

    def register(self, address: int, nbytes: int) -> None:
        self.device.log.append(f"register on {self.device.current}")
        if self.refuse:
            raise RuntimeError("refused (test)")

    def unregister(self, address: int) -> None:
        self.device.log.append(f"unregister on {self.device.current}")


def test_a_device_bound_registrar_guards_both_calls_and_waits_before_unregistering() -> None:
    device = GuardedDevice()
    registrar = DeviceBoundRegistrar(LoggingRuntime(device), device, torch.device("cuda", 3))
    assert repr(registrar) == "DeviceBoundRegistrar(LoggingRuntime, 'cuda:3')"
    registrar.register(PAGE_BYTES, PAGE_BYTES)
    registrar.unregister(PAGE_BYTES)
    assert device.log == [
        "enter 3",
        "register on 3",
        "leave 3",
        "enter 3",
        "synchronize cuda:3 on 3",
        "unregister on 3",
        "leave 3",
    ]


def test_a_device_bound_registrar_needs_a_device_index() -> None:
    device = GuardedDevice()
    with pytest.raises(ValueError, match="needs a device with an index, got cuda"):
        DeviceBoundRegistrar(LoggingRuntime(device), device, torch.device("cuda"))


def test_a_refused_registration_leaves_nothing_to_unregister() -> None:
    device = GuardedDevice()
    registrar = DeviceBoundRegistrar(LoggingRuntime(device, refuse=True), device, torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match=r"refused \(test\)"):
        registered_host_buffer(100, torch.float32, registrar)
    gc.collect()
    assert device.log == ["enter 0", "register on 0", "leave 0"]


# -- the CUDA runtime's cudaGetLastError (swap_core.torch_compat) --------------------
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="finds libraries through /proc/self/maps")
def test_a_function_of_a_library_the_process_loaded_is_found_and_callable() -> None:
    """The same search that finds ``cudaGetLastError`` in torch's CUDA runtime, tried on the C library."""
    assert runtime_library_function("getpid", "libc.so")() == os.getpid()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has a CUDA runtime")
@pytest.mark.parametrize(
    ("hip", "symbol", "library"),
    [(None, "cudaGetLastError", "libcudart.so"), ("6.2", "hipGetLastError", "libamdhip64.so")],
)
def test_without_a_cuda_runtime_the_last_error_cannot_be_reset_and_the_error_says_what_to_do(
    hip: str | None, symbol: str, library: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.version, "hip", hip)
    with pytest.raises(TorchCompatError) as raised:
        clear_cuda_last_error()
    message = str(raised.value)
    assert f"no {symbol} found" in message and f"no {library}* is mapped into this process" in message
    assert "SwapConfig(host_memory='caching')" in message
