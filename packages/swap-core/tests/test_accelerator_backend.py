"""AcceleratorBackend: validation and fallbacks on CPU (through a fake device module), real copies on a device.

The real-device tests run only with ``--backend cuda|npu`` on a machine that has one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import re
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import swap_core.backends.accelerator as accelerator
from swap_core.backend_selection import select_backend
from swap_core.backends.accelerator import SUPPORTED_DEVICE_TYPES, AcceleratorBackend
from swap_core.backends.device_types import DEVICE_TYPES, host_registrar
from swap_core.backends.host_memory import PAGE_BYTES, pinned_size
from swap_core.backends.host_registration import CudaHostRegistrar, HostRegistrar
from swap_core.backends.protocol import DeviceBackend
from swap_core.errors import PinnedMemoryWarning
from swap_core.torch_compat import TorchCompatError, clear_cuda_last_error


class FakeStream:
    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.waited_for: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited_for.append(event)


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded_on: object = None
        self.enable_timing = enable_timing

    def elapsed_time(self, end_event: FakeEvent) -> float:
        assert self.enable_timing and end_event.enable_timing, "elapsed_time needs timing events"
        return 2.5  # milliseconds

    def record(self, stream: object = None) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class FakeDeviceModule:
    """Stands in for ``torch.cuda`` so the backend's own logic runs on CPU; records what it is asked.

    ``log`` orders what the device and a :class:`FakeRegistrar` over it did, each with the current
    device index at the time (``device(index)`` changes it for its block).
    """

    def __init__(self) -> None:
        self.current = FakeStream()
        self.entered_streams: list[object] = []
        self.calls: list[tuple[str, torch.device]] = []
        self.current_index = 1
        self.log: list[tuple[str, object, int]] = []

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 2

    def current_device(self) -> int:
        return self.current_index

    @contextlib.contextmanager
    def device(self, device: int) -> Iterator[None]:
        previous, self.current_index = self.current_index, device
        try:
            yield
        finally:
            self.current_index = previous

    def Stream(self, device: torch.device) -> FakeStream:
        return FakeStream(device)

    def Event(self, enable_timing: bool = False) -> FakeEvent:
        return FakeEvent(enable_timing)

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: object) -> Iterator[None]:
        self.entered_streams.append(stream)
        yield

    def synchronize(self, device: torch.device) -> None:
        self.calls.append(("synchronize", device))
        self.log.append(("synchronize", device, self.current_index))

    def memory_allocated(self, device: torch.device) -> int:
        self.calls.append(("memory_allocated", device))
        return 1024

    def max_memory_allocated(self, device: torch.device) -> int:
        self.calls.append(("max_memory_allocated", device))
        return 4096

    def memory_reserved(self, device: torch.device) -> int:
        self.calls.append(("memory_reserved", device))
        return 8192

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        self.calls.append(("reset_peak_memory_stats", device))


class RecordCopies(TorchFunctionMode):
    """Records the ``non_blocking`` flag and the operands' layouts of every ``Tensor.copy_`` issued inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.non_blocking: list[bool] = []
        self.layouts: list[tuple[tuple[int, ...], bool, bool]] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            self.non_blocking.append(bool(kwargs.get("non_blocking", False)))
            dst, src = args[0], args[1]
            self.layouts.append((tuple(dst.shape), dst.is_contiguous(), src.is_contiguous()))
        return func(*args, **kwargs)


@pytest.fixture
def fake_module() -> FakeDeviceModule:
    return FakeDeviceModule()


@pytest.fixture
def fake_backend(fake_module: FakeDeviceModule) -> AcceleratorBackend:
    return AcceleratorBackend.from_device_module("cuda", fake_module)


def _fail_pinning(numel: int, dtype: torch.dtype) -> torch.Tensor:
    raise RuntimeError("cannot lock memory: memlock limit reached (test)")


# -- construction ---------------------------------------------------------------
@pytest.mark.parametrize("device_type", ["cpu", "tpu", "CUDA", "sim"])
def test_unknown_device_type_is_rejected_by_name(device_type: str) -> None:
    with pytest.raises(ValueError) as caught:
        AcceleratorBackend(device_type)
    message = str(caught.value)
    assert f"Unsupported accelerator device type {device_type!r}" in message
    assert "supports cuda, npu, xpu" in message
    assert SUPPORTED_DEVICE_TYPES == ("cuda", "npu", "xpu")


def test_unavailable_cuda_is_a_runtime_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="The cuda accelerator is not available") as caught:
        AcceleratorBackend("cuda")
    assert "backend='sim'" in str(caught.value)


def test_missing_torch_npu_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail even where installed
    with pytest.raises(RuntimeError) as caught:
        AcceleratorBackend("npu")
    message = str(caught.value)
    assert "The npu accelerator is not available" in message
    assert "torch_npu must be installed" in message and "pip install swap-core[npu]" in message


def test_every_list_of_backend_names_is_the_accelerator_backends_device_types(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from swap_core.config import BACKEND_NAMES
    from swap_core.testing.pytest_plugin import BACKEND_CHOICES

    assert ("auto", "sim", *SUPPORTED_DEVICE_TYPES) == BACKEND_NAMES
    assert ("sim", *SUPPORTED_DEVICE_TYPES) == BACKEND_CHOICES
    assert not accelerator.accelerator_available("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not accelerator.accelerator_available("cuda")
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert not accelerator.accelerator_available("npu")


def test_device_defaults_to_the_current_device(fake_backend: AcceleratorBackend) -> None:
    assert isinstance(fake_backend, DeviceBackend)
    assert fake_backend.name == "cuda"
    assert fake_backend.device == torch.device("cuda", 1)
    assert repr(fake_backend) == "AcceleratorBackend('cuda:1')"
    explicit = AcceleratorBackend.from_device_module("cuda", FakeDeviceModule(), device_index=0)
    assert explicit.device == torch.device("cuda", 0)


@pytest.mark.parametrize("device_index", [2, -1, True])
def test_invalid_device_index_is_rejected(fake_module: FakeDeviceModule, device_index: int) -> None:
    with pytest.raises(ValueError, match=f"Invalid cuda device index {device_index!r}: 2 device"):
        AcceleratorBackend.from_device_module("cuda", fake_module, device_index=device_index)


# -- host memory ----------------------------------------------------------------
def test_pinning_failure_falls_back_to_pageable_and_warns_once(
    fake_backend: AcceleratorBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(accelerator, "empty_pinned", _fail_pinning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buffers = [
            fake_backend.empty_host(6, torch.float32, mode="caching"),
            fake_backend.empty_host(3, torch.bfloat16, mode="caching"),
        ]
    pinned_warnings = [w for w in caught if issubclass(w.category, PinnedMemoryWarning)]
    assert len(pinned_warnings) == 1
    assert issubclass(pinned_warnings[0].category, UserWarning)
    message = str(pinned_warnings[0].message)
    assert "memlock limit reached (test)" in message
    assert "pageable memory" in message and "copies become synchronous" in message
    assert pinned_warnings[0].filename == __file__

    assert [(b.numel(), b.dtype, b.dim()) for b in buffers] == [(6, torch.float32, 1), (3, torch.bfloat16, 1)]
    assert not any(b.is_pinned() for b in buffers)
    buffers[0].copy_(torch.arange(6, dtype=torch.float32))
    assert buffers[0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_each_backend_instance_warns_for_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accelerator, "empty_pinned", _fail_pinning)
    with pytest.warns(PinnedMemoryWarning):
        AcceleratorBackend.from_device_module("cuda", FakeDeviceModule()).empty_host(1, torch.float32, mode="caching")
    with pytest.warns(PinnedMemoryWarning):
        AcceleratorBackend.from_device_module("cuda", FakeDeviceModule()).empty_host(1, torch.float32, mode="caching")


@pytest.mark.skipif(torch.accelerator.is_available(), reason="pinning works on this machine")
def test_cpu_only_torch_falls_back_with_torch_error(fake_backend: AcceleratorBackend) -> None:
    with pytest.warns(PinnedMemoryWarning, match="pin_memory=True requires"):
        buffer = fake_backend.empty_host(4, torch.float16, mode="caching")
    assert buffer.shape == (4,) and buffer.dtype == torch.float16


def test_pinned_allocation_is_used_when_it_works(
    fake_backend: AcceleratorBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    sentinel = torch.zeros(5)
    monkeypatch.setattr(accelerator, "empty_pinned", lambda numel, dtype: sentinel)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fake_backend.empty_host(5, torch.float32, mode="caching") is sentinel
    assert fake_backend.pinned_bytes(sentinel) == 32  # torch's caching allocator: 20 bytes round up to 32


class FakeRegistrar:
    """Stands in for cudaHostRegister / cudaHostUnregister; records the page-aligned ranges (and, given the
    device module, each call in its ``log`` with the current device index)."""

    def __init__(self, refuse: bool = False, module: FakeDeviceModule | None = None) -> None:
        self.refuse = refuse
        self.module = module
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def register(self, address: int, nbytes: int) -> None:
        if self.refuse:
            raise RuntimeError("cudaHostRegister returned cudaErrorHostMemoryAlreadyRegistered (test)")
        assert address % PAGE_BYTES == 0, "registered memory must be page-aligned"
        self.registered[address] = nbytes
        if self.module is not None:
            self.module.log.append(("register", address, self.module.current_index))

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)
        if self.module is not None:
            self.module.log.append(("unregister", address, self.module.current_index))


def test_exact_host_buffers_pin_their_size_to_the_page_until_the_last_view_is_gone() -> None:
    registrar = FakeRegistrar()
    backend = AcceleratorBackend.from_device_module("cuda", FakeDeviceModule(), registrar=registrar)
    numel = 10 * 2**20 // 4 + 1  # 10 MiB + 4 bytes of float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buffer = backend.empty_host(numel, torch.float32)
    assert buffer.shape == (numel,) and buffer.dtype == torch.float32
    assert list(registrar.registered.values()) == [10 * 2**20 + PAGE_BYTES]
    assert backend.pinned_bytes(buffer) == 10 * 2**20 + PAGE_BYTES  # the caching allocator would pin 16 MiB
    view = buffer[5:9].view(2, 2)
    view.fill_(3.0)
    del buffer
    gc.collect()
    assert registrar.unregistered == [], "unregistered while a view still used the memory"
    assert view.sum().item() == 12.0
    del view
    gc.collect()
    assert registrar.unregistered == list(registrar.registered)


@pytest.mark.parametrize(
    ("device_type", "registrar", "reason"),
    [("cuda", FakeRegistrar(refuse=True), "registering it with the driver failed"), ("xpu", None, "xpu has no public")],
    ids=["registration-refused", "no-registration-api"],
)
def test_exact_host_memory_falls_back_to_the_caching_allocator_and_warns_once(
    device_type: str, registrar: FakeRegistrar | None, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(accelerator, "empty_pinned", lambda numel, dtype: torch.empty(numel, dtype=dtype))
    module = FakeDeviceModule()
    backend = AcceleratorBackend.from_device_module(device_type, module, registrar=registrar)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buffers = [backend.empty_host(6, torch.float32), backend.empty_host(1000, torch.float32)]
    messages = [str(w.message) for w in caught if issubclass(w.category, PinnedMemoryWarning)]
    assert len(messages) == 1 and reason in messages[0] and "power of two" in messages[0]
    assert [backend.pinned_bytes(buffer) for buffer in buffers] == [32, 4096]


class FakeCudaError(int):
    """torch's ``cudaError`` enum binds only ``success``: any other status prints as ``cudaError.???``."""

    def __repr__(self) -> str:
        return "cudaError.success" if self == 0 else "cudaError.???"

    __str__ = __repr__


class FakeCudart:
    """Stands in for ``torch.cuda.cudart()``: a refused ``cudaHostRegister`` becomes the thread's last error, which
    the next kernel launch raises, as the CUDA runtime and torch's launch check do."""

    ERROR_TEXT = {712: "part or all of the requested memory range is already mapped"}
    cudaError = FakeCudaError

    def __init__(self, refuse: int = 0) -> None:
        self.refuse = refuse
        self.last_error = 0
        self.registered: list[tuple[int, int, int]] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> FakeCudaError:
        if self.refuse:
            self.last_error = self.refuse
            return FakeCudaError(self.refuse)
        self.registered.append((address, nbytes, flags))
        return FakeCudaError(0)

    def cudaHostUnregister(self, address: int) -> FakeCudaError:
        return FakeCudaError(0)

    def cudaGetErrorString(self, error: FakeCudaError) -> str:
        return self.ERROR_TEXT.get(int(error), "unknown error")

    def get_last_error(self) -> int:
        """``cudaGetLastError``: the last error, reset to success."""
        error, self.last_error = self.last_error, 0
        return error

    def launch_kernel(self) -> None:
        if self.last_error:
            raise RuntimeError(f"CUDA error: {self.ERROR_TEXT[self.last_error]}")


def test_a_refused_cuda_registration_resets_the_last_error_and_says_which_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fallback's first kernel launch must not raise the registration's error; the warning names it."""
    monkeypatch.setattr(accelerator, "empty_pinned", lambda numel, dtype: torch.empty(numel, dtype=dtype))
    cudart = FakeCudart(refuse=712)
    registrar = CudaHostRegistrar(cudart=lambda: cudart, clear_last_error=cudart.get_last_error)
    backend = AcceleratorBackend.from_device_module("cuda", FakeDeviceModule(), registrar=registrar)
    with pytest.warns(PinnedMemoryWarning) as caught:
        buffer = backend.empty_host(1000, torch.float32)
    message = str(caught[0].message)
    assert (
        f"cudaHostRegister({PAGE_BYTES} bytes) failed with CUDA error 712: "
        "part or all of the requested memory range is already mapped" in message
    )
    assert "???" not in message
    cudart.launch_kernel()
    assert backend.pinned_bytes(buffer) == 4096  # the caching allocator's rounding of 4000 bytes


def test_the_bindings_own_cuda_get_last_error_is_preferred() -> None:
    """A torch that binds ``cudaGetLastError`` needs no search of the loaded runtime library."""
    cudart = FakeCudart(refuse=712)
    cudart.cudaGetLastError = cudart.get_last_error  # type: ignore[attr-defined]

    def search_the_runtime_library() -> int:
        raise AssertionError("the runtime library was searched although the binding has cudaGetLastError")

    registrar = CudaHostRegistrar(cudart=lambda: cudart, clear_last_error=search_the_runtime_library)
    with pytest.raises(RuntimeError, match="CUDA error 712"):
        registrar.register(PAGE_BYTES, PAGE_BYTES)
    cudart.launch_kernel()


def test_a_refused_registration_whose_error_cannot_be_reset_is_raised_instead_of_falling_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(accelerator, "empty_pinned", lambda numel, dtype: torch.empty(numel, dtype=dtype))
    cudart = FakeCudart(refuse=712)

    def no_runtime_library() -> int:
        raise TorchCompatError("no cudaGetLastError found (test). Use SwapConfig(host_memory='caching')")

    registrar = CudaHostRegistrar(cudart=lambda: cudart, clear_last_error=no_runtime_library)
    backend = AcceleratorBackend.from_device_module("cuda", FakeDeviceModule(), registrar=registrar)
    with pytest.raises(TorchCompatError) as raised:
        backend.empty_host(1000, torch.float32)
    assert str(raised.value) == (
        f"cudaHostRegister({PAGE_BYTES} bytes) failed with CUDA error 712: part or all of the requested memory "
        "range is already mapped; no cudaGetLastError found (test). Use SwapConfig(host_memory='caching')"
    )


def _drop_in_another_thread(holder: list[torch.Tensor]) -> None:
    """Let the last reference to the buffers in ``holder`` die on a thread of its own, as a finalizer may."""

    def drop() -> None:
        holder.clear()
        gc.collect()

    thread = threading.Thread(target=drop)
    thread.start()
    thread.join()


def test_exact_buffers_are_registered_and_unregistered_on_the_backends_device_from_any_thread() -> None:
    """The thread's current device is 1, the backend's is 0: both runtime calls run under device 0's guard."""
    module = FakeDeviceModule()
    registrar = FakeRegistrar(module=module)
    backend = AcceleratorBackend.from_device_module("cuda", module, device_index=0, registrar=registrar)
    holder = [backend.empty_host(1000, torch.float32)]
    (address,) = registrar.registered
    assert module.log == [("register", address, 0)]
    assert module.current_device() == 1, "registering changed the thread's current device"
    _drop_in_another_thread(holder)
    assert module.log[1:] == [("synchronize", torch.device("cuda", 0), 0), ("unregister", address, 0)]
    assert module.current_device() == 1


def test_a_buffer_dropped_while_a_copy_may_still_write_it_is_unregistered_once_the_device_is_idle() -> None:
    """``opt.step(); del opt``: the last copy out to the buffer may still run; nothing else waits for it."""
    module = FakeDeviceModule()
    registrar = FakeRegistrar(module=module)
    backend = AcceleratorBackend.from_device_module("cuda", module, registrar=registrar)
    host = backend.empty_host(1000, torch.float32)
    backend.copy(host, torch.ones(1000), stream=backend.new_stream())
    (address,) = registrar.registered
    del host
    gc.collect()
    assert module.log[1:] == [("synchronize", torch.device("cuda", 1), 1), ("unregister", address, 1)]


def test_a_failed_unregistration_is_a_warning_and_the_range_is_still_unregistered() -> None:
    module = FakeDeviceModule()

    def broken_synchronize(device: torch.device) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (test)")

    module.synchronize = broken_synchronize  # type: ignore[method-assign]
    registrar = FakeRegistrar(module=module)
    backend = AcceleratorBackend.from_device_module("cuda", module, registrar=registrar)
    host = backend.empty_host(10, torch.float32)
    (address,) = registrar.registered
    with pytest.warns(PinnedMemoryWarning, match="illegal memory access was encountered"):
        del host
        gc.collect()
    assert registrar.unregistered == [address]


class FakeNpurt:
    """Stands in for torch_npu's ``torch.npu.npurt()``: statuses are plain ints, 0 for success."""

    def __init__(self, refuse: int = 0) -> None:
        self.refuse = refuse
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def npuHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        if self.refuse:
            return self.refuse
        self.registered.append((address, nbytes, flags))
        return 0

    def npuHostUnregister(self, address: int) -> int:
        self.unregistered.append(address)
        return 0


def _npu_registrar(monkeypatch: pytest.MonkeyPatch, npu_namespace: types.SimpleNamespace) -> HostRegistrar:
    """The registrar ``host_registrar("npu")`` finds with ``torch.npu`` as given (torch_npu's module, faked)."""
    monkeypatch.setattr(torch, "npu", npu_namespace, raising=False)
    registrar = host_registrar("npu")
    assert registrar is not None
    return registrar


def test_npu_pins_exact_buffers_through_torch_npus_npurt(monkeypatch: pytest.MonkeyPatch) -> None:
    npurt = FakeNpurt()
    registrar = _npu_registrar(monkeypatch, types.SimpleNamespace(npurt=lambda: npurt))
    module = FakeDeviceModule()
    # torch.device("npu") needs torch_npu itself: a cuda-named fake device drives the npu registrar.
    backend = AcceleratorBackend.from_device_module("cuda", module, device_index=0, registrar=registrar)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buffer = backend.empty_host(1000, torch.float32)
    address = buffer.data_ptr()
    assert npurt.registered == [(address, PAGE_BYTES, 0x10000000)]  # ACL_HOST_REG_PINNED: page-locking only
    assert backend.pinned_bytes(buffer) == pinned_size(4000, "exact")
    del buffer
    gc.collect()
    assert npurt.unregistered == [address]
    assert module.log == [("synchronize", torch.device("cuda", 0), 0)]


def test_a_refused_npu_registration_falls_back_to_the_caching_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    registrar = _npu_registrar(monkeypatch, types.SimpleNamespace(npurt=lambda: FakeNpurt(refuse=107000)))
    monkeypatch.setattr(accelerator, "empty_pinned", lambda numel, dtype: torch.empty(numel, dtype=dtype))
    backend = AcceleratorBackend.from_device_module("cuda", FakeDeviceModule(), registrar=registrar)
    with pytest.warns(PinnedMemoryWarning, match="registering it with the driver failed") as caught:
        buffer = backend.empty_host(1000, torch.float32)
    assert f"npuHostRegister({PAGE_BYTES} bytes) failed with ACL error 107000" in str(caught[0].message)
    assert backend.pinned_bytes(buffer) == 4096


def test_npu_has_a_registrar_only_where_torch_npu_offers_npurt_and_is_never_imported_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(), raising=False)  # a torch_npu without npurt
    assert host_registrar("npu") is None
    monkeypatch.delattr(torch, "npu")
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # an import would raise
    assert host_registrar("npu") is None
    assert host_registrar("xpu") is None


# -- copies, streams, events ------------------------------------------------------
def test_copy_runs_under_the_given_stream_and_blocks_for_pageable_memory(
    fake_backend: AcceleratorBackend, fake_module: FakeDeviceModule
) -> None:
    copy_stream = fake_backend.new_stream()
    dst, src = torch.zeros(4), torch.arange(4.0)
    with RecordCopies() as recorded:
        fake_backend.copy(dst, src, stream=copy_stream)
    assert fake_module.entered_streams == [copy_stream]
    assert recorded.non_blocking == [False]
    assert dst.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_copies_of_empty_host_buffers_know_they_are_pinned_without_asking_the_driver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``is_pinned()`` is a driver query per copy on CUDA: the buffers ``empty_host`` pinned (and their views) are
    known; any other host tensor is still asked."""
    monkeypatch.setattr(accelerator, "empty_pinned", lambda numel, dtype: torch.empty(numel, dtype=dtype))
    backend = AcceleratorBackend.from_device_module("cuda", FakeDeviceModule(), registrar=FakeRegistrar())
    exact = backend.empty_host(64, torch.float32)
    caching = backend.empty_host(64, torch.float32, mode="caching")
    pageable = torch.zeros(64)
    asked: list[int] = []
    is_pinned = torch.Tensor.is_pinned

    def counted_is_pinned(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        asked.append(tensor.data_ptr())
        return bool(is_pinned(tensor, *args, **kwargs))

    stream = backend.new_stream()
    with RecordCopies() as recorded:
        backend.copy(exact[8:16].view(2, 4), caching[:8].view(2, 4), stream=stream)
        backend.copy(pageable, exact, stream=stream)
    assert recorded.non_blocking == [True, False]
    assert torch.equal(pageable[8:16], caching[:8])
    monkeypatch.setattr(torch.Tensor, "is_pinned", counted_is_pinned)  # outside the mode, which would count twice
    backend.copy(exact[8:16].view(2, 4), caching[:8].view(2, 4), stream=stream)
    backend.copy(pageable, exact, stream=stream)
    assert asked == [pageable.data_ptr()], "the driver was asked about a buffer empty_host pinned"


def test_copy_enters_the_stream_only_when_it_is_not_already_current(
    fake_backend: AcceleratorBackend, fake_module: FakeDeviceModule
) -> None:
    dst, src = torch.zeros(4), torch.arange(4.0)
    fake_backend.copy(dst, src, stream=fake_backend.compute_stream())
    assert fake_module.entered_streams == []
    assert dst.tolist() == [0.0, 1.0, 2.0, 3.0]
    side = fake_backend.new_stream()
    fake_backend.copy(dst, src * 2, stream=side)
    assert fake_module.entered_streams == [side]
    assert dst.tolist() == [0.0, 2.0, 4.0, 6.0]


def _channels_last(buffer: torch.Tensor) -> torch.Tensor:
    return buffer[:120].view(2, 5, 4, 3).permute(0, 3, 1, 2)  # NCHW (2, 3, 5, 4) stored as NHWC


def _transposed(buffer: torch.Tensor) -> torch.Tensor:
    return buffer[:12].view(3, 4).t()


def _transposed_at_an_offset(buffer: torch.Tensor) -> torch.Tensor:
    return buffer[7:19].view(3, 4).t()


def _every_other_column(buffer: torch.Tensor) -> torch.Tensor:
    return buffer[:24].view(4, 6)[:, ::2]


def _contiguous(buffer: torch.Tensor) -> torch.Tensor:
    return buffer[7:19].view(4, 3)


@pytest.mark.parametrize(
    ("dst_layout", "src_layout", "copied"),
    [
        (_channels_last, _channels_last, ((120,), True, True)),
        (_transposed, _transposed, ((12,), True, True)),
        (_transposed_at_an_offset, _transposed_at_an_offset, ((12,), True, True)),
        (_transposed, _transposed_at_an_offset, ((12,), True, True)),  # one layout at another offset: still flat
        (_every_other_column, _every_other_column, ((4, 3), False, False)),  # not dense
        (_contiguous, _transposed, ((4, 3), True, False)),  # different strides
        (_contiguous, _contiguous, ((4, 3), True, True)),
    ],
    ids=["channels-last", "transposed", "transposed-offset", "offsets-differ", "not-dense", "strides-differ", "plain"],
)
def test_dense_copies_of_one_non_contiguous_layout_are_flat_copies_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
    fake_module: FakeDeviceModule,
    dst_layout: Callable[[torch.Tensor], torch.Tensor],
    src_layout: Callable[[torch.Tensor], torch.Tensor],
    copied: tuple[tuple[int, ...], bool, bool],
) -> None:
    """torch_npu copies host<->device directly only for contiguous tensors: same-layout dense ones go as 1-D.

    (An npu device cannot be made without torch_npu: the fake cuda backend is told to copy as npu does.)
    """
    monkeypatch.setitem(DEVICE_TYPES, "cuda", dataclasses.replace(DEVICE_TYPES["cuda"], flat_copies=True))
    fake_backend = AcceleratorBackend.from_device_module("cuda", fake_module)
    source = torch.arange(1.0, 129.0)
    destination, expected = torch.zeros(128), torch.zeros(128)
    dst_layout(expected).copy_(src_layout(source))
    with RecordCopies() as recorded:
        fake_backend.copy(dst_layout(destination), src_layout(source), stream=fake_backend.new_stream())
    assert torch.equal(destination, expected), "the copy wrote other elements, or other bytes, than a strided one"
    assert recorded.layouts == [copied]


def test_cuda_copies_a_non_contiguous_layout_as_it_is(fake_backend: AcceleratorBackend) -> None:
    """CUDA copies dense same-layout pairs directly: flattening them would only cost host time."""
    source, destination = torch.arange(1.0, 129.0), torch.zeros(128)
    with RecordCopies() as recorded:
        fake_backend.copy(_transposed(destination), _transposed(source), stream=fake_backend.new_stream())
    assert recorded.layouts == [((4, 3), False, False)]
    assert torch.equal(_transposed(destination), _transposed(source))


def test_a_step_refuses_to_be_captured_in_a_cuda_graph(
    fake_backend: AcceleratorBackend, fake_module: FakeDeviceModule
) -> None:
    assert not fake_backend.is_capturing(), "a device module without the query captures nothing"
    fake_module.is_current_stream_capturing = lambda: True  # type: ignore[attr-defined]
    assert fake_backend.is_capturing()


def test_streams_and_events_go_to_the_device_module(
    fake_backend: AcceleratorBackend, fake_module: FakeDeviceModule
) -> None:
    copy_stream = fake_backend.new_stream()
    assert isinstance(copy_stream, FakeStream) and copy_stream.device == torch.device("cuda", 1)
    compute = fake_backend.compute_stream()
    assert compute is fake_module.current

    event = fake_backend.record_event(copy_stream)
    assert isinstance(event, FakeEvent) and event.recorded_on is copy_stream
    fake_backend.wait_event(compute, event)
    assert fake_module.current.waited_for == [event]
    assert copy_stream.waited_for == []

    allocation_done = fake_backend.record_event(compute)
    fake_backend.wait_event(copy_stream, allocation_done)
    assert copy_stream.waited_for == [allocation_done]
    assert fake_module.current.waited_for == [event]


def test_sync_and_memory_stats_name_this_device(
    fake_backend: AcceleratorBackend, fake_module: FakeDeviceModule
) -> None:
    fake_backend.synchronize()
    assert fake_backend.memory_allocated() == 1024
    assert fake_backend.max_memory_allocated() == 4096
    assert fake_backend.memory_reserved() == 8192
    fake_backend.reset_peak_memory_stats()
    device = torch.device("cuda", 1)
    assert fake_module.calls == [
        ("synchronize", device),
        ("memory_allocated", device),
        ("max_memory_allocated", device),
        ("memory_reserved", device),
        ("reset_peak_memory_stats", device),
    ]


# -- storage and ownership --------------------------------------------------------
def test_release_and_restore_storage(fake_backend: AcceleratorBackend) -> None:
    tensor = torch.ones(3, 4, dtype=torch.float64)
    fake_backend.release_storage(tensor)
    # Never read a released tensor: on CPU that segfaults instead of raising.
    assert tensor.untyped_storage().nbytes() == 0
    assert tensor.shape == (3, 4)
    fake_backend.restore_storage(tensor)
    assert tensor.untyped_storage().nbytes() == 3 * 4 * 8
    tensor.fill_(2.0)
    assert tensor.sum().item() == 24.0


@pytest.mark.parametrize(
    ("make_view", "fragment"),
    [
        (lambda base: base[:, ::2], "stride (3, 2)"),
        (lambda base: base[1:], "offset 3"),
    ],
    ids=["not-dense", "offset"],
)
def test_restore_storage_needs_a_whole_storage_tensor(
    fake_backend: AcceleratorBackend, make_view: Callable[[torch.Tensor], torch.Tensor], fragment: str
) -> None:
    view = make_view(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"dense tensor at storage offset 0, .*" + re.escape(fragment)):
        fake_backend.restore_storage(view)


def test_restore_storage_regrows_a_dense_transposed_tensor(fake_backend: AcceleratorBackend) -> None:
    """A transposed (channels-last, ...) state densely fills its storage: it can be released and regrown."""
    view = torch.zeros(2, 3).t()
    fake_backend.release_storage(view)
    assert view.untyped_storage().nbytes() == 0
    fake_backend.restore_storage(view)
    assert view.untyped_storage().nbytes() == 6 * view.element_size()


def test_owns_and_adopt_check_the_device(fake_backend: AcceleratorBackend) -> None:
    host_tensor = torch.zeros(2)
    assert not fake_backend.owns(host_tensor)
    with pytest.raises(ValueError, match="Expected a tensor on cuda:1, got one on cpu"):
        fake_backend.adopt(host_tensor)
    with fake_backend.compute_scope():
        pass


# -- a real accelerator (--backend cuda|npu) --------------------------------------
@pytest.fixture
def real_backend(backend_name: str) -> AcceleratorBackend:
    if backend_name == "sim" or not torch.accelerator.is_available():
        pytest.skip("real-device test: run with --backend cuda|npu on a machine that has one")
    return AcceleratorBackend(backend_name)


@pytest.mark.parametrize("mode", ["exact", "caching"])
def test_real_pinned_round_trip_through_copy_streams(real_backend: AcceleratorBackend, mode: str) -> None:
    if mode == "exact" and host_registrar(real_backend.name) is None:
        pytest.skip(f"{real_backend.name} has no public host-registration API here: exact falls back to caching")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PinnedMemoryWarning)
        host = real_backend.empty_host(1 << 16, torch.float32, mode=mode)  # type: ignore[arg-type]
    assert host.is_pinned()
    host.copy_(torch.arange(1 << 16, dtype=torch.float32))
    device_tensor = real_backend.empty((1 << 16,), torch.float32)
    real_backend.adopt(device_tensor)
    compute, h2d, d2h = real_backend.compute_stream(), real_backend.new_stream(), real_backend.new_stream()

    real_backend.wait_event(h2d, real_backend.record_event(compute))  # allocation happened on compute
    real_backend.copy(device_tensor, host, stream=h2d)
    real_backend.wait_event(compute, real_backend.record_event(h2d))
    device_tensor.mul_(2)
    real_backend.wait_event(d2h, real_backend.record_event(compute))
    result = real_backend.empty_host(1 << 16, torch.float32)
    real_backend.copy(result, device_tensor, stream=d2h)
    real_backend.record_event(d2h).synchronize()
    assert torch.equal(result, torch.arange(1 << 16, dtype=torch.float32) * 2)


def test_real_exact_buffers_pin_to_the_page_outside_torchs_allocator_and_unregister(
    real_backend: AcceleratorBackend,
) -> None:
    """100 allocate/free cycles of a 3 MiB + 20 B buffer: pinned, page-rounded, never in torch's host allocator;
    a registration left behind would make the next one at the same address fail (warnings are errors here)."""
    if host_registrar(real_backend.name) is None:
        pytest.skip(f"{real_backend.name} has no public host-registration API here: exact falls back to caching")
    host_memory_stats = getattr(torch.get_device_module(real_backend.name), "host_memory_stats", dict)
    allocator_bytes = host_memory_stats().get("allocated_bytes.current", 0)
    numel = (3 << 20) // 4 + 5
    with warnings.catch_warnings():
        warnings.simplefilter("error", PinnedMemoryWarning)
        for _ in range(100):
            buffer = real_backend.empty_host(numel, torch.float32)
            assert buffer.is_pinned()
            assert real_backend.pinned_bytes(buffer) == (3 << 20) + PAGE_BYTES
            buffer.fill_(1.0)
            del buffer
            gc.collect()
    assert host_memory_stats().get("allocated_bytes.current", 0) == allocator_bytes


def test_real_refused_registration_leaves_no_error_for_the_next_kernel(real_backend: AcceleratorBackend) -> None:
    """Registering a registered range again is refused (cudaErrorHostMemoryAlreadyRegistered): the message names
    the error, and the next kernel launch does not raise it."""
    if real_backend.name != "cuda":
        pytest.skip("CUDA's per-thread last error")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PinnedMemoryWarning)
        buffer = real_backend.empty_host(PAGE_BYTES // 4, torch.float32)
    runtime = host_registrar("cuda")
    assert runtime is not None
    with pytest.raises(RuntimeError, match=r"cudaHostRegister\(\d+ bytes\) failed with CUDA error \d+: \w"):
        runtime.register(buffer.data_ptr(), PAGE_BYTES)
    assert clear_cuda_last_error() == 0, "the refusal's error was left set for the next kernel launch"
    assert torch.ones(4, device=real_backend.device).mul_(2).sum().item() == 8.0


def test_real_exact_buffers_register_on_the_backends_device_from_any_thread(real_backend: AcceleratorBackend) -> None:
    """A backend on device 1 while the thread's current device is 0 (torchrun without set_device): registered,
    copied and unregistered (on another thread) without a warning, the current device left as it was."""
    if host_registrar(real_backend.name) is None:
        pytest.skip(f"{real_backend.name} has no public host-registration API here")
    module = torch.get_device_module(real_backend.name)
    if module.device_count() < 2:
        pytest.skip("needs two devices: the backend's must differ from the thread's current one")
    values = torch.arange(1 << 20, dtype=torch.float32)
    with module.device(0), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = AcceleratorBackend(real_backend.name, 1)
        holder = [backend.empty_host(1 << 20, torch.float32)]
        assert module.current_device() == 0
        holder[0].copy_(values)
        device_tensor = backend.empty((1 << 20,), torch.float32)
        h2d = backend.new_stream()
        backend.wait_event(h2d, backend.record_event(backend.compute_stream()))
        backend.copy(device_tensor, holder[0], stream=h2d)
        backend.record_event(h2d).synchronize()
        _drop_in_another_thread(holder)
        assert module.current_device() == 0
        assert torch.equal(device_tensor.cpu(), values)
    assert [str(w.message) for w in caught if issubclass(w.category, PinnedMemoryWarning)] == []


def test_real_a_buffer_dropped_during_its_copy_out_is_unregistered_once_the_copy_is_done(
    real_backend: AcceleratorBackend,
) -> None:
    """``opt.step(); del opt``: a 256 MiB copy out is still running when its buffer is dropped."""
    if host_registrar(real_backend.name) is None:
        pytest.skip(f"{real_backend.name} has no public host-registration API here")
    numel = 64 << 20
    device_tensor = torch.full((numel,), 3.0, device=real_backend.device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PinnedMemoryWarning)
        host = real_backend.empty_host(numel, torch.float32)
    d2h = real_backend.new_stream()
    real_backend.wait_event(d2h, real_backend.record_event(real_backend.compute_stream()))
    real_backend.copy(host, device_tensor, stream=d2h)
    copied = real_backend.record_event(d2h)
    del host
    gc.collect()
    assert copied.query(), "the buffer was unregistered and unmapped while its copy could still write it"
    assert device_tensor.sum().item() == 3.0 * numel


def test_real_channels_last_states_copy_both_ways(real_backend: AcceleratorBackend) -> None:
    """A channels-last state and its host mirror of the same layout: copied (flat) and back, values intact."""
    host = real_backend.empty_host(2 * 3 * 32 * 32, torch.float32)
    host_view = host.view(2, 32, 32, 3).permute(0, 3, 1, 2)
    host_view.copy_(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)))
    expected = host_view.clone()
    device_tensor = torch.empty_like(host_view, device=real_backend.device)
    assert device_tensor.stride() == host_view.stride()
    compute, h2d, d2h = real_backend.compute_stream(), real_backend.new_stream(), real_backend.new_stream()
    real_backend.wait_event(h2d, real_backend.record_event(compute))
    real_backend.copy(device_tensor, host_view, stream=h2d)
    real_backend.wait_event(compute, real_backend.record_event(h2d))
    device_tensor.mul_(2)
    real_backend.wait_event(d2h, real_backend.record_event(compute))
    real_backend.copy(host_view, device_tensor, stream=d2h)
    real_backend.record_event(d2h).synchronize()
    assert torch.equal(host_view, expected * 2)


def test_real_release_and_restore_change_allocated_bytes(real_backend: AcceleratorBackend) -> None:
    tensor = real_backend.empty((1 << 20,), torch.float32)
    real_backend.synchronize()
    before = real_backend.memory_allocated()
    real_backend.release_storage(tensor)
    assert real_backend.memory_allocated() == before - (4 << 20)
    real_backend.restore_storage(tensor)
    assert real_backend.memory_allocated() == before
    tensor.fill_(1.0)
    assert tensor.sum().item() == float(1 << 20)
    assert real_backend.owns(tensor) and not real_backend.owns(tensor.cpu())


def test_timing_events_measure_device_time_in_seconds() -> None:
    module = FakeDeviceModule()
    backend = AcceleratorBackend.from_device_module("cuda", module)  # type: ignore[arg-type]
    start = backend.record_event(backend.compute_stream(), timing=True)
    end = backend.record_event(backend.compute_stream(), timing=True)
    assert backend.elapsed_seconds(start, end) == 0.0025
    assert not backend.record_event(backend.compute_stream()).enable_timing  # type: ignore[attr-defined]


def test_a_device_backend_is_taken_for_an_optimizer_without_parameters_yet(fake_backend: AcceleratorBackend) -> None:
    """An optimizer whose groups come later (``AdamW([{"params": []}])``, then ``add_param_group``): the backend given
    is taken as it is. (Found on an H200: with no parameter the check asked whether a CUDA backend owns CPU memory;
    the simulator owns CPU tensors, so only a device showed it.)"""
    assert select_backend(fake_backend, []) is fake_backend
    assert select_backend("auto", []) is None, "auto follows parameters: with none, nothing is swapped yet"
    with pytest.raises(ValueError, match="does not own parameters on cpu"):
        select_backend(fake_backend, [torch.zeros(3)])


def test_real_available_device_bytes_counts_free_memory_and_unused_cached_blocks(
    real_backend: AcceleratorBackend,
) -> None:
    """What ``swap_times="auto"`` plans with: ``mem_get_info``'s free bytes plus what torch's allocator caches unused
    (a freed block stays reserved, so the driver's free memory alone would under-count it)."""
    before = real_backend.available_device_bytes()
    assert before is not None and before > 0
    block = torch.empty(64 << 20, dtype=torch.uint8, device=real_backend.device)
    during = real_backend.available_device_bytes()
    assert during is not None and during <= before - (64 << 20) + (2 << 20)
    del block
    after = real_backend.available_device_bytes()
    assert after is not None and abs(after - before) <= 2 << 20, (before, during, after)
