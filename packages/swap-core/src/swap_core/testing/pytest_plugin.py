"""pytest plugin that runs swap's test suites against a chosen device backend.

Load it with ``pytest_plugins = ("swap_core.testing.pytest_plugin",)`` in a root
``conftest.py`` (the swap monorepo does). It adds:

* the option ``--backend sim|cuda|npu|xpu`` (default ``sim``, the simulated accelerator
  over CPU memory, so every suite runs on CPU-only machines);
* the session fixture ``backend_name``: the chosen name; with an accelerator a test
  that uses it is skipped when that accelerator is not available;
* the fixture ``swap_backend_factory``: a callable ``(mode="lazy", seed=0)`` that
  builds a fresh :class:`~swap_core.backends.protocol.DeviceBackend` of the chosen
  kind (``mode`` and ``seed`` only steer the simulator);
* the marker ``sim_only`` for tests of the simulator itself (races, poison, fault
  injection), skipped with any other ``--backend``;
* the option ``--sim-schedules one|all``: whether a test parametrized over simulator
  schedules runs under each of them or once (the default off the simulator);
* the option ``--per-test-timeout SECONDS``: a time limit on each phase of each test,
  with the standard library only (see :func:`pytest_addoption`).

Which tests run where, stated once:

* A test reaches the chosen backend only through ``swap_backend_factory`` (or
  ``backend_name``). With ``--backend sim`` every test runs.
* With a real backend (``cuda``, ``npu``, ``xpu``):

  - a test marked ``sim_only`` is skipped at collection;
  - a test that builds a :class:`~swap_core.sim.SimBackend` itself (``SimBackend(...)``,
    ``SwapConfig(backend="sim")``) hard-codes the simulator: it is ``sim_only`` whether
    marked or not, and is skipped at the moment it builds one, with a reason that says so
    (the terminal summary lists such tests, so they can be marked);
  - the simulator's schedules collapse to one: of the tests that differ only in the
    ``mode`` (a simulator mode: ``lazy``, ``sync``, ``random``) and ``seed`` parameters
    (:data:`~swap_core.testing.conformance.SIM_MODES`, ``OPTION_MODES``, ``HABIT_MODES``),
    the first collected one runs and the others are deselected (counted in the summary);
    a real device ignores both, so the others would repeat it exactly.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Literal, Protocol, get_args

import pytest

from swap_core.backends.accelerator import SUPPORTED_DEVICE_TYPES, accelerator_available

if TYPE_CHECKING:
    from swap_core.backends.protocol import DeviceBackend
    from swap_core.sim import SimMode

__all__ = [
    "BACKEND_CHOICES",
    "SCHEDULE_PARAMS",
    "SIM_ONLY_MARKER",
    "BackendFactory",
    "SimSchedules",
    "accelerator_available",
    "backend_name",
    "swap_backend_factory",
]

BACKEND_CHOICES = ("sim", *SUPPORTED_DEVICE_TYPES)
"""Values accepted by ``--backend``: the simulator and every device type the accelerator backend drives."""

SIM_ONLY_MARKER = "sim_only"
"""Marker of tests that only make sense on the simulated accelerator."""

SCHEDULE_PARAMS: tuple[str, ...] = ("mode", "seed")
"""Parameter names of a simulator schedule; a test is schedule-parametrized when its ``mode`` is a simulator mode."""

SimSchedules = Literal["one", "all"]
"""``--sim-schedules``: every schedule of a schedule-parametrized test, or only the first one."""

_SIM_MODE_NAMES: frozenset[str] = frozenset(("lazy", "random", "sync"))
"""The simulator's modes (``swap_core.sim.SIM_MODES``), without importing the simulator at plugin load."""

_TIMEOUT_GRACE_S = 30.0
"""Longest wait, after a phase's time is up, for the interpreter to run the failing signal handler (a hung
device call never returns to it); then every thread's traceback is dumped and the process ends."""

_deselected_key = pytest.StashKey[int]()
_hard_coded_key = pytest.StashKey[list[str]]()
_stderr_key = pytest.StashKey[int]()


class BackendFactory(Protocol):
    """Builds a fresh backend of the kind chosen with ``--backend``."""

    def __call__(self, mode: SimMode = "lazy", seed: int = 0) -> DeviceBackend:
        """``mode`` and ``seed`` configure :class:`~swap_core.sim.SimBackend`; real devices ignore them."""
        ...


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("swap", "swap device backends")
    group.addoption(
        "--backend",
        action="store",
        choices=BACKEND_CHOICES,
        default="sim",
        help=f"device backend the swap tests run on: sim (simulated accelerator on CPU, default) or one of "
        f"{', '.join(SUPPORTED_DEVICE_TYPES)}",
    )
    group.addoption(
        "--sim-schedules",
        action="store",
        choices=get_args(SimSchedules),
        default=None,
        help="tests parametrized over simulator schedules (parameters 'mode' and 'seed': lazy, sync, random "
        "seeds): 'all' runs each schedule, 'one' only the first collected and deselects the others. Default: "
        "all with --backend sim, one with a real device (which ignores both parameters)",
    )
    group.addoption(
        "--per-test-timeout",
        action="store",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="fail a test whose setup, call or teardown takes more than SECONDS (each phase has its own "
        "SECONDS; standard library only, no plugin needed). In the main thread a SIGALRM fails the test with "
        "the traceback of where it was, and the session goes on; a phase stuck in native code (a hung device "
        f"call) never returns to the interpreter, so SECONDS + min(SECONDS, {_TIMEOUT_GRACE_S:g}) after the "
        "phase started faulthandler dumps every thread's traceback to stderr and ends the process (exit "
        "status 1). Off the main thread (or without SIGALRM) only that last resort applies. Do not combine "
        "with the faulthandler_timeout ini option (both use faulthandler.dump_traceback_later)",
    )


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return seconds


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{SIM_ONLY_MARKER}: tests the simulated accelerator itself; skipped with any other --backend",
    )
    config.stash[_deselected_key] = 0
    config.stash[_hard_coded_key] = []
    if _per_test_timeout(config) is not None:
        if float(config.getini("faulthandler_timeout") or 0) > 0:
            raise pytest.UsageError("--per-test-timeout and the faulthandler_timeout ini option exclude each other")
        # The watchdog writes to the terminal's stderr: a copy taken now, as pytest's faulthandler plugin does,
        # since a process it ends never shows what pytest captured.
        config.stash[_stderr_key] = os.dup(_stderr_fileno())


def pytest_unconfigure(config: pytest.Config) -> None:
    if _stderr_key in config.stash:
        os.close(config.stash[_stderr_key])
        del config.stash[_stderr_key]


def pytest_report_header(config: pytest.Config) -> list[str]:
    timeout = _per_test_timeout(config)
    return [
        f"swap backend: {config.getoption('backend')}, simulator schedules: {_sim_schedules(config)}"
        f"{'' if timeout is None else f', per-test timeout: {timeout:g} s'}"
    ]


@pytest.hookimpl(trylast=True)  # after -k / -m, so that a schedule chosen with -k is the one kept
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _sim_schedules(config) == "one":
        repeats = _schedule_repeats(items)
        if repeats:
            dropped = set(map(id, repeats))
            items[:] = [item for item in items if id(item) not in dropped]
            config.hook.pytest_deselected(items=repeats)
            config.stash[_deselected_key] = len(repeats)
    backend = config.getoption("backend")
    if backend == "sim":
        return
    skip_sim_only = pytest.mark.skip(reason=f"{SIM_ONLY_MARKER}: needs the simulator, running with --backend {backend}")
    for item in items:
        if item.get_closest_marker(SIM_ONLY_MARKER) is not None:
            item.add_marker(skip_sim_only)


def _schedule_repeats(items: Sequence[pytest.Item]) -> list[pytest.Item]:
    """The items that repeat an earlier one under another simulator schedule (same test, same other parameters)."""
    seen: set[tuple[Hashable, ...]] = set()
    repeats: list[pytest.Item] = []
    for item in items:
        group = _schedule_group(item)
        if group is None:
            continue
        if group in seen:
            repeats.append(item)
        else:
            seen.add(group)
    return repeats


def _schedule_group(item: pytest.Item) -> tuple[Hashable, ...] | None:
    """The test and its parameters other than the schedule's, or ``None`` when it has no simulator ``mode``."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    params: dict[str, object] = callspec.params
    mode = params.get("mode")
    if not isinstance(mode, str) or mode not in _SIM_MODE_NAMES:
        return None
    others = tuple((name, _identity(value)) for name, value in sorted(params.items()) if name not in SCHEDULE_PARAMS)
    return (item.nodeid.partition("[")[0], *others)


def _identity(value: object) -> Hashable:
    """``value`` where it can be hashed; else the object itself stands for it (parametrize reuses the objects)."""
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))
    return (type(value).__qualname__, value)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    deselected = config.stash.get(_deselected_key, 0)
    if deselected:
        terminalreporter.write_line(
            f"swap: {deselected} repeats under other simulator schedules deselected (--sim-schedules one)"
        )
    hard_coded = config.stash.get(_hard_coded_key, [])
    if hard_coded:
        terminalreporter.write_line(
            f"swap: {len(hard_coded)} test(s) build a SimBackend themselves without the {SIM_ONLY_MARKER} marker "
            f"(skipped with --backend {config.getoption('backend')}; mark them):"
        )
        for nodeid in hard_coded:
            terminalreporter.write_line(f"  {nodeid}")


# -- each phase of a test: the simulator guard and the time limit -------------------------
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _simulator_guard(item), _time_limit(item, "setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _simulator_guard(item), _time_limit(item, "call"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    with _time_limit(item, "teardown"):
        return (yield)


@contextlib.contextmanager
def _simulator_guard(item: pytest.Item) -> Iterator[None]:
    """With a real backend, a test not marked ``sim_only`` that builds a ``SimBackend`` is skipped right there."""
    backend = item.config.getoption("backend")
    if backend == "sim" or item.get_closest_marker(SIM_ONLY_MARKER) is not None:
        yield
        return
    from swap_core.sim import SimBackend

    build = SimBackend.__init__

    def refuse(self: SimBackend, *args: object, **kwargs: object) -> None:
        if type(self) is not SimBackend:  # CpuBackend, MetaBackend: not the simulated accelerator
            build(self, *args, **kwargs)  # type: ignore[arg-type]
            return
        hard_coded = item.config.stash[_hard_coded_key]
        if item.nodeid not in hard_coded:
            hard_coded.append(item.nodeid)
        pytest.skip(
            f"builds a SimBackend itself (hard-codes the simulator), so it is {SIM_ONLY_MARKER}; "
            f"running with --backend {backend}"
        )

    SimBackend.__init__ = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        SimBackend.__init__ = build  # type: ignore[method-assign]


@contextlib.contextmanager
def _time_limit(item: pytest.Item, phase: str) -> Iterator[None]:
    """``--per-test-timeout`` around one phase: SIGALRM fails it, a faulthandler watchdog ends a hung process."""
    seconds = _per_test_timeout(item.config)
    if seconds is None:
        yield
        return
    faulthandler.dump_traceback_later(
        seconds + min(seconds, _TIMEOUT_GRACE_S), exit=True, file=item.config.stash[_stderr_key]
    )
    alarm = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    previous: Callable[[int, FrameType | None], object] | int | None = None
    if alarm:

        def expire(signum: int, frame: FrameType | None) -> None:
            pytest.fail(f"{phase} of {item.nodeid} took more than --per-test-timeout {seconds:g} s")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()


def _per_test_timeout(config: pytest.Config) -> float | None:
    seconds = config.getoption("per_test_timeout", None)
    return None if seconds is None else float(seconds)


def _sim_schedules(config: pytest.Config) -> SimSchedules:
    chosen = config.getoption("sim_schedules", None)
    if chosen is not None:
        return "one" if chosen == "one" else "all"
    return "all" if config.getoption("backend") == "sim" else "one"


def _stderr_fileno() -> int:
    """The file descriptor of ``sys.stderr``, or of the process's original stderr where it has none (xdist)."""
    try:
        fileno = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        fileno = -1
    if fileno < 0 and sys.__stderr__ is not None:
        fileno = sys.__stderr__.fileno()
    return fileno


@pytest.fixture(scope="session")
def backend_name(pytestconfig: pytest.Config) -> str:
    """The ``--backend`` of this run; skips the test when that accelerator is missing."""
    name = str(pytestconfig.getoption("backend"))
    if name != "sim" and not accelerator_available(name):
        pytest.skip(f"--backend {name}: no {name} device is available on this machine")
    return name


@pytest.fixture
def swap_backend_factory(backend_name: str) -> BackendFactory:
    """A callable building a fresh backend of the ``--backend`` kind for each call."""

    def make_backend(mode: SimMode = "lazy", seed: int = 0) -> DeviceBackend:
        if backend_name == "sim":
            from swap_core.sim import SimBackend

            return SimBackend(mode=mode, seed=seed)
        from swap_core.backends.accelerator import AcceleratorBackend

        return AcceleratorBackend(backend_name)

    return make_backend
