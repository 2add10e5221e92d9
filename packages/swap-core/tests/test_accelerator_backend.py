"""AcceleratorBackend: validation and fallbacks on CPU (through a fake device module), real copies on a device.

The real-device tests run only with ``--backend cuda|npu`` on a machine that has one.
"""

from __future__ import annotations

import contextlib
import gc
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import swap_core.backends.accelerator as accelerator
from swap_core.backends.accelerator import SUPPORTED_DEVICE_TYPES, AcceleratorBackend
from swap_core.backends.protocol import DeviceBackend
from swap_core.errors import PinnedMemoryWarning


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
    """Stands in for ``torch.cuda`` so the backend's own logic runs on CPU; records what it is asked."""

    def __init__(self) -> None:
        self.current = FakeStream()
        self.entered_streams: list[object] = []
        self.calls: list[tuple[str, torch.device]] = []

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 2

    def current_device(self) -> int:
        return 1

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
    """Records the ``non_blocking`` flag of every ``Tensor.copy_`` issued inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.non_blocking: list[bool] = []

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
        return func(*args, **kwargs)


@pytest.fixture
def fake_module() -> FakeDeviceModule:
    return FakeDeviceModule()


@pytest.fixture
def fake_backend(fake_module: FakeDeviceModule) -> AcceleratorBackend:
    return AcceleratorBackend._from_module("cuda", fake_module)


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
    explicit = AcceleratorBackend._from_module("cuda", FakeDeviceModule(), device_index=0)
    assert explicit.device == torch.device("cuda", 0)


@pytest.mark.parametrize("device_index", [2, -1, True])
def test_invalid_device_index_is_rejected(fake_module: FakeDeviceModule, device_index: int) -> None:
    with pytest.raises(ValueError, match=f"Invalid cuda device index {device_index!r}: 2 device"):
        AcceleratorBackend._from_module("cuda", fake_module, device_index=device_index)


# -- host memory ----------------------------------------------------------------
def test_pinning_failure_falls_back_to_pageable_and_warns_once(
    fake_backend: AcceleratorBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(accelerator, "_empty_pinned", _fail_pinning)
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
    monkeypatch.setattr(accelerator, "_empty_pinned", _fail_pinning)
    with pytest.warns(PinnedMemoryWarning):
        AcceleratorBackend._from_module("cuda", FakeDeviceModule()).empty_host(1, torch.float32, mode="caching")
    with pytest.warns(PinnedMemoryWarning):
        AcceleratorBackend._from_module("cuda", FakeDeviceModule()).empty_host(1, torch.float32, mode="caching")


@pytest.mark.skipif(torch.accelerator.is_available(), reason="pinning works on this machine")
def test_cpu_only_torch_falls_back_with_torch_error(fake_backend: AcceleratorBackend) -> None:
    with pytest.warns(PinnedMemoryWarning, match="pin_memory=True requires"):
        buffer = fake_backend.empty_host(4, torch.float16, mode="caching")
    assert buffer.shape == (4,) and buffer.dtype == torch.float16


def test_pinned_allocation_is_used_when_it_works(
    fake_backend: AcceleratorBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    sentinel = torch.zeros(5)
    monkeypatch.setattr(accelerator, "_empty_pinned", lambda numel, dtype: sentinel)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fake_backend.empty_host(5, torch.float32, mode="caching") is sentinel
    assert fake_backend.pinned_bytes(sentinel) == 32  # torch's caching allocator: 20 bytes round up to 32


class FakeRegistrar:
    """Stands in for cudaHostRegister / cudaHostUnregister; records the page-aligned ranges."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def register(self, address: int, nbytes: int) -> None:
        if self.refuse:
            raise RuntimeError("cudaHostRegister returned cudaErrorHostMemoryAlreadyRegistered (test)")
        assert address % 4096 == 0, "registered memory must be page-aligned"
        self.registered[address] = nbytes

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


def test_exact_host_buffers_pin_their_size_to_the_page_until_the_last_view_is_gone() -> None:
    registrar = FakeRegistrar()
    backend = AcceleratorBackend._from_module("cuda", FakeDeviceModule(), registrar=registrar)
    numel = 10 * 2**20 // 4 + 1  # 10 MiB + 4 bytes of float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buffer = backend.empty_host(numel, torch.float32)
    assert buffer.shape == (numel,) and buffer.dtype == torch.float32
    assert list(registrar.registered.values()) == [10 * 2**20 + 4096]
    assert backend.pinned_bytes(buffer) == 10 * 2**20 + 4096  # the caching allocator would pin 16 MiB
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
    monkeypatch.setattr(accelerator, "_empty_pinned", lambda numel, dtype: torch.empty(numel, dtype=dtype))
    module = FakeDeviceModule()
    backend = AcceleratorBackend._from_module(device_type, module, registrar=registrar)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buffers = [backend.empty_host(6, torch.float32), backend.empty_host(1000, torch.float32)]
    messages = [str(w.message) for w in caught if issubclass(w.category, PinnedMemoryWarning)]
    assert len(messages) == 1 and reason in messages[0] and "power of two" in messages[0]
    assert [backend.pinned_bytes(buffer) for buffer in buffers] == [32, 4096]


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
    if mode == "exact" and real_backend.name != "cuda":
        pytest.skip(f"{real_backend.name} has no public host-registration API: exact falls back to caching")
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
    if real_backend.name != "cuda":
        pytest.skip("exact-size pinning registers memory through the CUDA runtime")
    allocator_bytes = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    numel = (3 << 20) // 4 + 5
    with warnings.catch_warnings():
        warnings.simplefilter("error", PinnedMemoryWarning)
        for _ in range(100):
            buffer = real_backend.empty_host(numel, torch.float32)
            assert buffer.is_pinned()
            assert real_backend.pinned_bytes(buffer) == (3 << 20) + 4096
            buffer.fill_(1.0)
            del buffer
            gc.collect()
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == allocator_bytes


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
    backend = AcceleratorBackend._from_module("cuda", module)  # type: ignore[arg-type]
    start = backend.record_event(backend.compute_stream(), timing=True)
    end = backend.record_event(backend.compute_stream(), timing=True)
    assert backend.elapsed_seconds(start, end) == 0.0025
    assert not backend.record_event(backend.compute_stream()).enable_timing  # type: ignore[attr-defined]
