"""Defects fixed on the simulator, checked again on a real CUDA device (``--backend cuda`` only; skipped otherwise).

The simulator found each of these as a missing wait between streams or between the device and the host. On
hardware such a wait only shows when the work it should wait for is still running, so every test here delays
that work with ``torch.cuda._sleep`` (a kernel that spins for a number of clock cycles) queued ahead of it,
and checks what a user relies on: the swapped optimizer stays bitwise equal to the plain one, and ``step()``
does not block the host. The sizes are a training step's in miniature (8 parameters of 64 MiB in 4 batches:
128 MiB of RMSprop state per batch, 256 MiB of Adam's), so each test takes milliseconds of device time on
an H200 plus the registration of its pinned host memory. CI never runs these (it has no CUDA device):
``tools/device-check.sh part1`` does, on a lent machine.

Where a test asserts that a delayed event has *not* completed yet (``event.query()`` is False), that is the
evidence that the host did not wait for it; when it fails with "the timing window closed", the host was
slower than ``SPIN_MS`` between two calls and the test says nothing: raise ``SPIN_MS``.

Run on an H200 (torch 2.11, driver 580, one GPU) on 2026-12-04: 17 passed, the two-GPU test skipped. Each fix
was then removed in turn (monkeypatched, on that machine): the re-layout test fails without the store's wait for
the offloads, the side-stream test when the backend orders copies after the default stream, the backward-prefetch
test (reserved memory +768 MiB in 5 steps) when the hooks' prefetch stays on the hooks' stream, the registration
test when the refused call's last error is not read. The dropping test passed with both of its waits removed (the
finalizer's and the registrar's): there, unregistering the memory appears to wait for the device by itself.
"""

from __future__ import annotations

import functools
import gc
import mmap
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, cast

import pytest
import torch

from swap_core import SwapConfig, SwapOptimizer, default_registry, swap_optimizer
from swap_core.backends.device_types import host_registrar
from swap_core.errors import AdapterNotFoundError, PinnedMemoryWarning
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

SHAPE = (4096, 4096)
"""One parameter: 64 MiB of fp32 (and as much per state it has)."""

PARAMS = 8
SWAP_TIMES = 4
"""8 parameters in 4 batches: 2 parameters' states per batch."""

BATCH_STATE_BYTES = {"rmsprop": 2 * 64 << 20, "adam": 2 * 2 * 64 << 20}
"""Swapped state bytes of one batch: RMSprop keeps ``square_avg``; Adam ``exp_avg`` and ``exp_avg_sq``."""

SPIN_MS = 200.0
"""How long the delaying kernel spins: far longer than the host needs to issue a step of 8 parameters."""

FAMILIES: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}
"""RMSprop's adapter ships with swap-core; Adam's with swap-adam (tests over Adam skip where it is missing)."""

WINDOW_CLOSED = (
    "the timing window closed: the delaying kernel ended before the host got here, so this run checks nothing "
    f"(raise SPIN_MS, now {SPIN_MS:g} ms)"
)


# -- fixtures and helpers -------------------------------------------------------------
@pytest.fixture
def cuda(backend_name: str) -> Iterator[torch.device]:
    """The current CUDA device; the test is skipped unless the run has ``--backend cuda`` (and a CUDA device)."""
    if backend_name != "cuda":
        pytest.skip(f"a CUDA hardware risk: runs with --backend cuda only (this run has --backend {backend_name})")
    device = torch.device("cuda", torch.cuda.current_device())
    yield device
    torch.cuda.synchronize(device)  # nothing of this test still runs when the next one starts


class DeviceEvent(Protocol):
    """The part of ``torch.cuda.Event`` these tests use (torch leaves its methods untyped)."""

    def record(self, stream: torch.cuda.Stream) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: DeviceEvent) -> float: ...


def new_event(*, timing: bool = False) -> DeviceEvent:
    return cast(DeviceEvent, torch.cuda.Event(enable_timing=timing))  # type: ignore[no-untyped-call]


def new_stream(device: torch.device) -> torch.cuda.Stream:
    stream: torch.cuda.Stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return stream


def spin(ms: float, device: torch.device) -> DeviceEvent:
    """Queue a kernel that keeps ``device``'s current stream busy for about ``ms``; the event completes after it.

    The current device is left as it was (a stream context on another device switches it for the block only).
    """
    stream = torch.cuda.current_stream(device)
    done = new_event()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(ms * _cycles_per_ms(device.index)))  # type: ignore[no-untyped-call]
        done.record(stream)
    return done


@functools.cache
def _cycles_per_ms(index: int | None) -> float:
    """Clock cycles ``torch.cuda._sleep`` spins per millisecond on device ``index``, measured once."""
    stream = torch.cuda.current_stream(index)
    start, end = new_event(timing=True), new_event(timing=True)
    cycles = 20_000_000
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1_000)  # type: ignore[no-untyped-call]  # loads the kernel
        start.record(stream)
        torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
        end.record(stream)
    end.synchronize()
    return cycles / start.elapsed_time(end)


def make_params(device: torch.device, count: int = PARAMS) -> list[torch.nn.Parameter]:
    """``count`` parameters of ``SHAPE``, the same values at every call."""
    generator = torch.Generator(device=device).manual_seed(0)
    return [torch.nn.Parameter(torch.randn(SHAPE, generator=generator, device=device)) for _ in range(count)]


def set_grads(params: Sequence[torch.Tensor], step: int, *, without: Sequence[int] = ()) -> None:
    """The gradients of ``step`` (the same for any copy of the parameters); ``without``: indices left without one."""
    generator = torch.Generator(device=params[0].device).manual_seed(1_000 + step)
    for index, param in enumerate(params):
        grad = torch.randn(SHAPE, generator=generator, device=param.device)
        param.grad = None if index in without else grad


def wrap(plain: torch.optim.Optimizer, **options: object) -> SwapOptimizer:
    """``plain`` swapped on CUDA in ``SWAP_TIMES`` batches (skips the test when no adapter serves its class)."""
    try:
        default_registry.resolve(plain)
    except AdapterNotFoundError:
        pytest.skip(f"no swap adapter for {type(plain).__name__} is installed (swap-adam serves Adam)")
    return swap_optimizer(plain, SwapConfig(backend="cuda", swap_times=SWAP_TIMES).replace(**options))


def assert_same(
    plain_params: Sequence[torch.Tensor],
    plain: torch.optim.Optimizer,
    swapped_params: Sequence[torch.Tensor],
    swapped: SwapOptimizer,
    context: str,
) -> None:
    """Parameters and state dicts bitwise equal, once the device is done (on the parameters' device)."""
    torch.cuda.synchronize(plain_params[0].device)
    for index, (expected, actual) in enumerate(zip(plain_params, swapped_params, strict=True)):
        assert_bitwise_equal(expected, actual, f"{context}: parameter {index}")
    assert_state_dicts_equal(plain.state_dict(), swapped.state_dict(), context)


class Twins:
    """A plain optimizer and a swapped one of the same family over identical parameters, stepped alike."""

    def __init__(self, device: torch.device, family: str, **options: object) -> None:
        self.plain_params = make_params(device)
        self.swapped_params = make_params(device)
        self.plain = FAMILIES[family](self.plain_params)
        self.swapped = wrap(FAMILIES[family](self.swapped_params), **options)
        self.device = device

    def step(self, step: int, *, without: Sequence[int] = (), delay_swapped: bool = False) -> DeviceEvent | None:
        """Both step with the gradients of ``step``; ``delay_swapped``: a spin is queued right before the swapped
        step (its event is returned), so everything the step issues runs after it."""
        set_grads(self.plain_params, step, without=without)
        self.plain.step()
        set_grads(self.swapped_params, step, without=without)
        spun = spin(SPIN_MS, self.device) if delay_swapped else None
        self.swapped.step()
        return spun

    def assert_same(self, context: str) -> None:
        assert_same(self.plain_params, self.plain, self.swapped_params, self.swapped, context)


# -- the risks ------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("edit", ["first_gradient", "reordered_param_groups"])
def test_a_relayout_waits_for_the_delayed_last_offload_of_the_step_before(
    cuda: torch.device, family: str, edit: str
) -> None:
    """Step 1's copies are delayed; before they ran, step 2 re-lays the host mirrors out: for a parameter with its
    first gradient (its states are added to the packed buffers), or for param groups edited by hand (reordered).
    A re-layout that does not wait for step 1's last offload copies stale host values: the states lose step 1.

    The new layout's host memory comes from torch's caching pinned allocator, from a block freed beforehand: a
    fresh pinned allocation (``cudaHostAlloc``, or ``cudaHostRegister`` for exact-size buffers) synchronizes the
    device and hides a missing wait (on an H200 this test passed with the wait removed, in exact mode)."""
    twins = Twins(cuda, family, host_memory="caching")
    late = PARAMS - 1 if edit == "first_gradient" else None
    without = () if late is None else (late,)
    twins.step(0, without=without)  # creates the states (and waits for the device while it fills them)
    # One free cached block of the layout's size (the step 2 layout has the same power of two), for step 2 to take.
    free_block = torch.empty(twins.swapped.stats.host_pinned_bytes, dtype=torch.uint8, pin_memory=True)
    del free_block
    spun = twins.step(1, without=without, delay_swapped=True)
    assert spun is not None and not spun.query(), WINDOW_CLOSED
    if edit == "reordered_param_groups":
        for optimizer in (twins.plain, twins.swapped):
            optimizer.param_groups[0]["params"].reverse()
    set_grads(twins.plain_params, 2)
    twins.plain.step()
    set_grads(twins.swapped_params, 2)
    assert not spun.query(), WINDOW_CLOSED
    twins.swapped.step()  # the re-layout happens here, while step 1's offload still waits behind the spin
    twins.step(3)
    twins.assert_same(f"{family}, {edit} at step 2 after a delayed step 1")


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_a_step_under_another_stream_updates_and_copies_on_that_stream(
    cuda: torch.device, family: str, packed: bool
) -> None:
    """``with torch.cuda.stream(side): opt.step()`` updates on ``side``; its copies must be ordered after ``side``
    too. The spin delays the updates on ``side``: an offload ordered after another (idle) stream copies a batch
    out before its update, and the host mirrors keep the step before's values."""
    twins = Twins(cuda, family, packed=packed)
    side = new_stream(cuda)
    side.wait_stream(torch.cuda.current_stream(cuda))  # the parameters were made on the default stream
    with torch.cuda.stream(side):
        for step in range(4):
            twins.step(step, delay_swapped=True)
    twins.assert_same(f"{family}, {'packed' if packed else 'per-tensor'}, 4 steps under a side stream")


def test_backward_prefetch_from_hooks_under_another_stream_stages_on_the_steps_stream(cuda: torch.device) -> None:
    """``SwapConfig(prefetch="backward")`` with the forward and backward under another stream (as FSDP2 runs
    gradient hooks under its post-reduce stream): the prefetch issued from the hooks allocates its staging on the
    stream the steps run on, so the device's reserved memory does not grow by a batch's staging at each step."""
    twins = Twins(cuda, "rmsprop", prefetch="backward")
    side = new_stream(cuda)
    compute = torch.cuda.current_stream(cuda)
    reserved: list[int] = []
    for step in range(8):
        for params, optimizer in ((twins.plain_params, twins.plain), (twins.swapped_params, twins.swapped)):
            for param in params:
                param.grad = None
            generator = torch.Generator(device=cuda).manual_seed(2_000 + step)
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                loss = sum((param * torch.randn(SHAPE, generator=generator, device=cuda)).sum() for param in params)
                assert isinstance(loss, torch.Tensor)
                loss.backward()  # type: ignore[no-untyped-call]
            compute.wait_stream(side)
            if optimizer is twins.swapped and step > 0:  # the first step has no state to prefetch yet
                assert twins.swapped.prefetched, f"step {step}: the backward's hooks did not prefetch"
            optimizer.step()
        reserved.append(torch.cuda.memory_reserved(cuda))
    growth = reserved[-1] - reserved[2]
    assert growth < BATCH_STATE_BYTES["rmsprop"], (
        f"memory reserved on {cuda} grew by {growth} B over 5 steps (a batch's staging is "
        f"{BATCH_STATE_BYTES['rmsprop']} B): {reserved}"
    )
    twins.assert_same("backward prefetch from hooks under a side stream, 8 steps")


def test_gradients_freed_under_another_stream_are_not_reused_before_their_update(cuda: torch.device) -> None:
    """``SwapConfig(step="in_backward", free_gradients=True)`` with the backward under another stream (FSDP2's
    post-reduce stream): the gradients, allocated on that stream, are freed inside the backward while their updates
    wait on the steps' stream behind a spin. Tensors allocated on the side stream right after, of the gradients'
    size, and filled with NaN must not take the gradients' blocks before the updates read them (``record_stream``
    in ``free_when_done``): else the swapped parameters turn NaN."""
    twins = Twins(cuda, "rmsprop", step="in_backward", free_gradients=True)
    side = new_stream(cuda)
    compute = torch.cuda.current_stream(cuda)
    for step in range(4):
        set_grads(twins.plain_params, step)
        twins.plain.step()
        for param in twins.swapped_params:
            param.grad = None
        generator = torch.Generator(device=cuda).manual_seed(1_000 + step)
        side.wait_stream(compute)  # the parameters as the last step left them
        spun = spin(SPIN_MS, cuda)  # the updates issued from the hooks wait behind it
        with torch.cuda.stream(side):
            grads = [torch.randn(SHAPE, generator=generator, device=cuda) for _ in twins.swapped_params]
            loss = sum((param * grad).sum() for param, grad in zip(twins.swapped_params, grads, strict=True))
            assert isinstance(loss, torch.Tensor)
            loss.backward()  # type: ignore[no-untyped-call]
            del grads, loss
            junk = [torch.full(SHAPE, float("nan"), device=cuda) for _ in range(PARAMS)]
        if step > 0:
            assert all(param.grad is None for param in twins.swapped_params), f"step {step}: not freed"
            assert not spun.query(), WINDOW_CLOSED
        compute.wait_stream(side)
        twins.swapped.step()
        del junk
    twins.assert_same("gradients freed inside a backward under a side stream, 4 steps")


def test_a_refused_host_registration_falls_back_and_the_next_kernel_launch_runs(
    cuda: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cudaHostRegister`` refused with a real CUDA error (registering a range a second time): the backend falls
    back to torch's pinned allocator with a warning, and the refused call's error, which CUDA keeps as the
    thread's last error, is cleared: else the next kernel launch raises it."""
    runtime = host_registrar("cuda")
    assert runtime is not None
    register = type(runtime).register
    refusals: list[str] = []

    def register_twice(self: object, address: int, nbytes: int) -> None:
        register(self, address, nbytes)  # type: ignore[arg-type]
        try:
            register(self, address, nbytes)  # type: ignore[arg-type]  # cudaErrorHostMemoryAlreadyRegistered
        except RuntimeError as error:
            refusals.append(str(error))
            raise
        finally:
            torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]  # the first one

    monkeypatch.setattr(type(runtime), "register", register_twice)
    plain_params, swapped_params = make_params(cuda, 2), make_params(cuda, 2)
    plain = torch.optim.RMSprop(plain_params, lr=1e-3)
    swapped = wrap(torch.optim.RMSprop(swapped_params, lr=1e-3), swap_times=2)
    set_grads(plain_params, 0)
    plain.step()
    set_grads(swapped_params, 0)
    with pytest.warns(PinnedMemoryWarning, match="registering it with the driver failed"):
        swapped.step()  # creates the states: their host buffers are registered (refused) here
    assert refusals, "the registration was not refused: the premise of this test does not hold on this machine"
    probe = torch.ones(1024, device=cuda)
    probe.add_(1)  # a kernel launch right after the refusal
    torch.cuda.synchronize(cuda)
    assert probe.sum().item() == 2048
    for step in (1, 2):
        set_grads(plain_params, step)
        plain.step()
        set_grads(swapped_params, step)
        swapped.step()
    assert_same(plain_params, plain, swapped_params, swapped, "after a refused registration")


def test_host_memory_is_registered_on_the_backends_device_not_the_current_one(cuda: torch.device) -> None:
    """Parameters on the last GPU while the current device is another (torchrun without ``set_device``): host
    buffers are registered in the parameters' device context. Registered in the current device's instead, they
    are pageable for the parameters' device: a copy out to them blocks the host until the delayed step is done,
    and unregistering them from the right context fails when the optimizer goes."""
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"needs 2 CUDA devices, this machine has {count}")
    device = torch.device("cuda", count - 1)
    current = torch.cuda.current_device()
    assert current != device.index
    plain_params, swapped_params = make_params(device), make_params(device)
    plain = torch.optim.RMSprop(plain_params, lr=1e-3)
    swapped = wrap(torch.optim.RMSprop(swapped_params, lr=1e-3))
    assert swapped.backend is not None and swapped.backend.device == device
    for step in range(3):
        set_grads(plain_params, step)
        plain.step()
        set_grads(swapped_params, step)
        spun = spin(SPIN_MS, device) if step == 2 else None
        swapped.step()
        assert spun is None or not spun.query(), (
            f"step() on {device} waited on the host for its copies: its host buffers are not pinned for {device}"
        )
    assert torch.cuda.current_device() == current, "swapping changed the current device"
    assert_same(plain_params, plain, swapped_params, swapped, f"{device} while cuda:{current} is current")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del swapped
        gc.collect()
    failures = [str(warning.message) for warning in caught if issubclass(warning.category, PinnedMemoryWarning)]
    assert not failures, failures
    assert torch.cuda.current_device() == current


def test_dropping_the_optimizer_right_after_a_delayed_step_waits_for_its_copies(cuda: torch.device) -> None:
    """``opt.step(); del opt; gc.collect()`` while that step's copies wait behind a spin: the optimizer's exact-size
    pinned buffers are unregistered and unmapped only once those copies are done, so nothing crashes and memory
    mapped afterwards at the same addresses keeps what the host writes into it.

    On an H200 (driver 580) this test passed with the optimizer's own waits removed (``cudaHostUnregister``
    appears to wait for the device by itself): it guards runtimes and drivers that do not."""
    params = make_params(cuda)
    swapped = wrap(torch.optim.RMSprop(params, lr=1e-3))
    set_grads(params, 0)
    swapped.step()  # creates the states
    ranges = sorted(
        {
            (value.untyped_storage().data_ptr(), value.untyped_storage().nbytes())
            for state in swapped.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor) and value.is_cpu and value.dim() > 0
        }
    )
    assert ranges, "no host mirror found"
    set_grads(params, 1)
    spun = spin(SPIN_MS, cuda)
    swapped.step()
    assert not spun.query(), WINDOW_CLOSED
    collected = weakref.ref(swapped)
    del swapped
    gc.collect()
    assert collected() is None, "something still holds the swapped optimizer"
    assert spun.query(), "the optimizer's host buffers were let go of before its delayed copies ran"
    fresh = [mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE) for _, nbytes in ranges]
    views = [torch.frombuffer(mapping, dtype=torch.uint8) for mapping in fresh]
    for view in views:
        view.fill_(0x5A)
    reused = sum(any(start <= view.data_ptr() < start + nbytes for start, nbytes in ranges) for view in views)
    torch.cuda.synchronize(cuda)
    time.sleep(SPIN_MS / 1000)  # a copy still in flight would land in the meantime
    for index, view in enumerate(views):
        assert bool((view == 0x5A).all()), (
            f"host memory mapped after the optimizer was dropped was overwritten (buffer {index}; "
            f"{reused} of {len(views)} new mappings reuse an old address)"
        )


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_wall_clock_the_step_after_a_delayed_one_does_not_block_the_host(cuda: torch.device, packed: bool) -> None:
    """WALL-CLOCK CHECK, the only one in the suite (never in CI, which has no CUDA device): after a step whose last
    offload is delayed, the next step takes staging memory from the caching allocator while the blocks the step
    before freed are still in use by that offload: the allocator must take other blocks (or the same ones,
    stream-ordered), never make the host wait. Evidence: the delayed event is still pending when the step
    returns, and the host side of the step took a small part of the delay (a generous factor of 4)."""
    twins = Twins(cuda, "rmsprop", packed=packed)
    for step in range(2):  # the states exist and the allocator has cached a step's staging
        twins.step(step)
    torch.cuda.synchronize(cuda)
    spun = twins.step(2, delay_swapped=True)
    assert spun is not None
    set_grads(twins.swapped_params, 3)
    assert not spun.query(), WINDOW_CLOSED
    started = time.perf_counter()
    twins.swapped.step()
    host_seconds = time.perf_counter() - started
    assert not spun.query(), "the step after a delayed one waited on the host for the delayed step's copies"
    assert host_seconds < SPIN_MS / 1000 / 4, (
        f"the host side of the step took {host_seconds * 1000:.1f} ms behind a {SPIN_MS:g} ms delay"
    )
    set_grads(twins.plain_params, 3)
    twins.plain.step()
    twins.assert_same(f"{'packed' if packed else 'per-tensor'}, a step right after a delayed one")


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_step_returns_before_a_sleep_queued_on_the_compute_stream_ends(
    cuda: torch.device, family: str, packed: bool
) -> None:
    """The pipeline is asynchronous: ``step()`` issues its copies and updates behind whatever the compute stream
    still runs and returns at once (only the first step, which fills the new host states, waits)."""
    twins = Twins(cuda, family, packed=packed)
    twins.step(0)
    spun = twins.step(1, delay_swapped=True)
    assert spun is not None and not spun.query(), "step() waited on the host for the work queued before it"
    twins.assert_same(f"{family}, {'packed' if packed else 'per-tensor'}, a step behind a spin")
