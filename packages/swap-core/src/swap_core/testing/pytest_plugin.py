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
  injection), skipped with any other ``--backend``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import pytest

from swap_core.backends.accelerator import SUPPORTED_DEVICE_TYPES, accelerator_available

if TYPE_CHECKING:
    from swap_core.backends.protocol import DeviceBackend
    from swap_core.sim import SimMode

__all__ = [
    "BACKEND_CHOICES",
    "SIM_ONLY_MARKER",
    "BackendFactory",
    "accelerator_available",
    "backend_name",
    "swap_backend_factory",
]

BACKEND_CHOICES = ("sim", *SUPPORTED_DEVICE_TYPES)
"""Values accepted by ``--backend``: the simulator and every device type the accelerator backend drives."""

SIM_ONLY_MARKER = "sim_only"
"""Marker of tests that only make sense on the simulated accelerator."""


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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{SIM_ONLY_MARKER}: tests the simulated accelerator itself; skipped with any other --backend",
    )


def pytest_report_header(config: pytest.Config) -> str:
    return f"swap backend: {config.getoption('backend')}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    backend = config.getoption("backend")
    if backend == "sim":
        return
    skip_sim_only = pytest.mark.skip(reason=f"{SIM_ONLY_MARKER}: needs the simulator, running with --backend {backend}")
    for item in items:
        if item.get_closest_marker(SIM_ONLY_MARKER) is not None:
            item.add_marker(skip_sim_only)


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
