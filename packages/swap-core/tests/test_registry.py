"""The adapter registry as plugin authors and users meet it, with injected entry points."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import textwrap
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import swap_core.adapters.registry as registry_module
from swap_core.adapters import (
    ADAPTER_API_VERSION,
    AdapterRegistry,
    StateInit,
    StateSwapAdapter,
    UpdateBatch,
    register_adapter,
)
from swap_core.errors import (
    AdapterLoadError,
    AdapterLoadWarning,
    AdapterNotFoundError,
    AdapterVersionError,
    DuplicateAdapterError,
)

GROUP = "swap_core.adapters"

PluginMaker = Callable[[str, str], importlib.metadata.EntryPoint]


class _NoopAdapter(StateSwapAdapter):
    def initial_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor | StateInit]:
        return {}

    def update(self, batch: UpdateBatch) -> None:
        pass


def sgd_factory(optimizer: torch.optim.Optimizer) -> StateSwapAdapter:
    return _NoopAdapter(optimizer)


def adam_factory(optimizer: torch.optim.Optimizer) -> StateSwapAdapter:
    return _NoopAdapter(optimizer)


class MyAdam(torch.optim.Adam):
    """A user subclass: must be served by Adam's adapter."""


def _params() -> list[torch.Tensor]:
    return [torch.zeros(2, requires_grad=True)]


@pytest.fixture(autouse=True)
def _not_strict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWAP_STRICT_PLUGINS", raising=False)


@pytest.fixture
def make_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginMaker]:
    """Write a uniquely named plugin module and return its entry point (``name = "module:register"``)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    created: list[str] = []

    def make(entry_name: str, body: str) -> importlib.metadata.EntryPoint:
        module_name = f"swap_test_plugin_{uuid.uuid4().hex}"
        (tmp_path / f"{module_name}.py").write_text(textwrap.dedent(body))
        created.append(module_name)
        return importlib.metadata.EntryPoint(name=entry_name, value=f"{module_name}:register", group=GROUP)

    yield make
    for module_name in created:
        sys.modules.pop(module_name, None)


def _module_of(entry_point: importlib.metadata.EntryPoint) -> ModuleType:
    return sys.modules[entry_point.module]


SGD_PLUGIN = """
    import torch
    CALLS = []

    def factory(optimizer):
        raise AssertionError("not built in these tests")

    def register(registry):
        CALLS.append(registry)
        registry.register(torch.optim.SGD, factory, name="sgd")
"""

BROKEN_IMPORT_PLUGIN = """
    import swap_nonexistent_dependency_for_tests

    def register(registry):
        pass
"""


def test_discovery_is_lazy_and_happens_once(make_plugin: PluginMaker) -> None:
    entry_point = make_plugin("sgd", SGD_PLUGIN)
    registry = AdapterRegistry(entry_points=lambda: [entry_point])
    assert entry_point.module not in sys.modules, "constructing the registry must not import plugins"

    factory = registry.resolve(torch.optim.SGD(_params(), lr=0.1))
    plugin = _module_of(entry_point)
    assert factory is plugin.factory
    assert len(plugin.CALLS) == 1 and plugin.CALLS[0] is registry

    registry.resolve(torch.optim.SGD(_params(), lr=0.1))
    assert registry.registered() == {"sgd": torch.optim.SGD}
    assert len(plugin.CALLS) == 1


def test_default_entry_point_source_reads_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def fake_entry_points(*, group: str) -> list[importlib.metadata.EntryPoint]:
        asked.append(group)
        return []

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    registry = AdapterRegistry(group="my.group")
    assert asked == []
    assert registry.registered() == {}
    assert asked == ["my.group"]


def test_subclass_resolves_through_mro() -> None:
    registry = AdapterRegistry(entry_points=list)
    registry.register(torch.optim.Adam, adam_factory, name="adam")
    assert registry.resolve(MyAdam(_params())) is adam_factory
    assert registry.resolve(torch.optim.AdamW(_params())) is adam_factory  # AdamW subclasses Adam


def test_nearest_class_in_mro_wins() -> None:
    registry = AdapterRegistry(entry_points=list)
    registry.register(torch.optim.Adam, adam_factory, name="adam")
    registry.register(MyAdam, sgd_factory, name="my-adam")
    assert registry.resolve(MyAdam(_params())) is sgd_factory
    assert registry.resolve(torch.optim.Adam(_params())) is adam_factory


def test_explicit_registration_and_listing() -> None:
    registry = AdapterRegistry(entry_points=list)
    assert registry.api_version == ADAPTER_API_VERSION
    registry.register(torch.optim.SGD, sgd_factory, name="sgd")
    registry.register(torch.optim.Adam, adam_factory, name="adam")
    assert registry.registered() == {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}
    assert registry.resolve(torch.optim.SGD(_params(), lr=0.1)) is sgd_factory


def test_register_adapter_uses_default_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = AdapterRegistry(entry_points=list)
    monkeypatch.setattr(registry_module, "default_registry", fresh)
    register_adapter(torch.optim.SGD, sgd_factory, name="sgd")
    assert fresh.resolve(torch.optim.SGD(_params(), lr=0.1)) is sgd_factory


def test_same_class_under_another_adapter_is_a_duplicate() -> None:
    registry = AdapterRegistry(entry_points=list)
    registry.register(torch.optim.Adam, adam_factory, name="adam")
    with pytest.raises(DuplicateAdapterError) as caught:
        registry.register(torch.optim.Adam, sgd_factory, name="fast-adam")
    message = str(caught.value)
    assert "torch.optim.adam.Adam already has adapter 'adam'" in message
    assert "'fast-adam'" in message and "adam_factory" in message and "sgd_factory" in message
    assert "replace=True" in message
    assert registry.resolve(torch.optim.Adam(_params())) is adam_factory, "the failed call must change nothing"


def test_same_name_for_another_class_is_a_duplicate() -> None:
    registry = AdapterRegistry(entry_points=list)
    registry.register(torch.optim.Adam, adam_factory, name="adam")
    with pytest.raises(DuplicateAdapterError) as caught:
        registry.register(torch.optim.SGD, adam_factory, name="adam")
    message = str(caught.value)
    assert "'adam' is already registered for torch.optim.adam.Adam" in message
    assert "torch.optim.sgd.SGD" in message
    assert registry.registered() == {"adam": torch.optim.Adam}


def test_replace_overrides_both_ways() -> None:
    registry = AdapterRegistry(entry_points=list)
    registry.register(torch.optim.Adam, adam_factory, name="adam")
    registry.register(torch.optim.Adam, sgd_factory, name="fast-adam", replace=True)
    assert registry.registered() == {"fast-adam": torch.optim.Adam}
    registry.register(torch.optim.SGD, sgd_factory, name="fast-adam", replace=True)
    assert registry.registered() == {"fast-adam": torch.optim.SGD}
    with pytest.raises(AdapterNotFoundError):
        registry.resolve(torch.optim.Adam(_params()))


def test_identical_reregistration_is_a_noop() -> None:
    registry = AdapterRegistry(entry_points=list)
    registry.register(torch.optim.Adam, adam_factory, name="adam")
    registry.register(torch.optim.Adam, adam_factory, name="adam")
    assert registry.registered() == {"adam": torch.optim.Adam}


def test_explicit_registration_clashing_with_a_plugin_fails_at_the_call(make_plugin: PluginMaker) -> None:
    entry_point = make_plugin("sgd", SGD_PLUGIN)
    registry = AdapterRegistry(entry_points=lambda: [entry_point])
    with pytest.raises(DuplicateAdapterError, match=re.escape("torch.optim.sgd.SGD already has adapter 'sgd'")):
        registry.register(torch.optim.SGD, sgd_factory, name="my-sgd")
    registry.register(torch.optim.SGD, sgd_factory, name="my-sgd", replace=True)
    assert registry.resolve(torch.optim.SGD(_params(), lr=0.1)) is sgd_factory


def test_api_version_mismatch_names_adapter_and_versions() -> None:
    registry = AdapterRegistry(entry_points=list)
    with pytest.raises(AdapterVersionError) as caught:
        registry.register(torch.optim.Adam, adam_factory, name="adam", api_version=ADAPTER_API_VERSION + 1)
    message = str(caught.value)
    assert f"'adam' for torch.optim.adam.Adam targets adapter API version {ADAPTER_API_VERSION + 1}" in message
    assert f"supports version {ADAPTER_API_VERSION}" in message
    assert registry.registered() == {}


@pytest.mark.parametrize(
    ("optimizer_cls", "factory", "name", "error", "fragment"),
    [
        (torch.nn.Linear, adam_factory, "x", TypeError, "torch.optim.Optimizer subclass, got <class"),
        (torch.optim.Adam(_params()), adam_factory, "x", TypeError, "torch.optim.Optimizer subclass"),
        (torch.optim.Adam, "not callable", "x", TypeError, "factory must be callable"),
        (torch.optim.Adam, adam_factory, "", ValueError, "non-empty string, got ''"),
        (torch.optim.Adam, adam_factory, 3, TypeError, "must be a str, got int"),
    ],
    ids=["not-optimizer-class", "optimizer-instance", "factory-not-callable", "empty-name", "name-not-str"],
)
def test_register_validates_arguments(
    optimizer_cls: object, factory: object, name: object, error: type[Exception], fragment: str
) -> None:
    registry = AdapterRegistry(entry_points=list)
    with pytest.raises(error, match=re.escape(fragment)):
        registry.register(optimizer_cls, factory, name=name)  # type: ignore[arg-type]


def test_broken_plugin_warns_once_and_others_still_resolve(make_plugin: PluginMaker) -> None:
    broken = make_plugin("broken", BROKEN_IMPORT_PLUGIN)
    healthy = make_plugin("sgd", SGD_PLUGIN)
    registry = AdapterRegistry(entry_points=lambda: [broken, healthy])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        factory = registry.resolve(torch.optim.SGD(_params(), lr=0.1))
        registry.resolve(torch.optim.SGD(_params(), lr=0.1))
        registry.registered()
    assert factory is _module_of(healthy).factory
    load_warnings = [w for w in caught if issubclass(w.category, AdapterLoadWarning)]
    assert len(load_warnings) == 1
    message = str(load_warnings[0].message)
    assert f"'broken' ({broken.value})" in message
    assert "ModuleNotFoundError" in message and "swap_nonexistent_dependency_for_tests" in message
    assert load_warnings[0].filename == __file__, "the warning points at the code that triggered discovery"


def test_broken_plugin_and_miss_raise_load_error_naming_it(make_plugin: PluginMaker) -> None:
    broken = make_plugin("adam", BROKEN_IMPORT_PLUGIN)
    registry = AdapterRegistry(entry_points=lambda: [broken])
    with pytest.warns(AdapterLoadWarning), pytest.raises(AdapterLoadError) as caught:
        registry.resolve(torch.optim.Adam(_params()))
    assert not isinstance(caught.value, AdapterNotFoundError)
    message = str(caught.value)
    assert "No swap adapter is registered for torch.optim.adam.Adam" in message
    assert f"'adam' ({broken.value}): ModuleNotFoundError" in message
    assert "swap_nonexistent_dependency_for_tests" in message


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            """
            def register(registry):
                raise RuntimeError("plugin exploded")
            """,
            "RuntimeError: plugin exploded",
        ),
        ("register = 42\n", "TypeError: {value} must be a register(registry) function, got int"),
        (
            """
            import torch
            def register(registry):
                registry.register(torch.optim.SGD, print, name="old-sgd", api_version=registry.api_version - 1)
            """,
            "AdapterVersionError: Adapter 'old-sgd' for torch.optim.sgd.SGD targets adapter API version",
        ),
    ],
    ids=["raises", "not-callable", "api-version"],
)
def test_plugin_failures_are_reported_with_their_error(make_plugin: PluginMaker, body: str, expected: str) -> None:
    entry_point = make_plugin("bad", body)
    registry = AdapterRegistry(entry_points=lambda: [entry_point])
    with pytest.warns(AdapterLoadWarning) as caught:
        assert registry.registered() == {}
    assert expected.format(value=entry_point.value) in str(caught[0].message)


def test_strict_mode_raises_at_discovery(make_plugin: PluginMaker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWAP_STRICT_PLUGINS", "1")
    broken = make_plugin("broken", BROKEN_IMPORT_PLUGIN)
    healthy = make_plugin("sgd", SGD_PLUGIN)
    registry = AdapterRegistry(entry_points=lambda: [broken, healthy])
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdapterLoadWarning)  # strict mode raises instead of warning
        with pytest.raises(AdapterLoadError) as caught:
            registry.resolve(torch.optim.SGD(_params(), lr=0.1))
    message = str(caught.value)
    assert f"'broken' ({broken.value}): ModuleNotFoundError" in message
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)
    with pytest.raises(AdapterLoadError):
        registry.resolve(torch.optim.SGD(_params(), lr=0.1))


def test_not_found_names_the_package_and_registered_adapters() -> None:
    registry = AdapterRegistry(entry_points=list)
    registry.register(torch.optim.SGD, sgd_factory, name="sgd")
    with pytest.raises(AdapterNotFoundError) as caught:
        registry.resolve(torch.optim.AdamW(_params()))
    message = str(caught.value)
    assert "No swap adapter is registered for torch.optim.adamw.AdamW" in message
    assert "Registered adapters: 'sgd' -> torch.optim.sgd.SGD." in message
    assert "--find-links dist swap-core swap-adam" in message


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is new in this torch")
def test_not_found_for_muon_names_swap_muon() -> None:
    registry = AdapterRegistry(entry_points=list)
    with pytest.raises(AdapterNotFoundError, match=r"Registered adapters: none\. .*dist swap-core swap-muon"):
        registry.resolve(torch.optim.Muon([torch.zeros(2, 2, requires_grad=True)]))


def test_not_found_for_an_optimizer_without_a_family_names_swap_generic() -> None:
    registry = AdapterRegistry(entry_points=list)
    with pytest.raises(AdapterNotFoundError) as caught:
        registry.resolve(torch.optim.SGD(_params(), lr=0.1))
    message = str(caught.value)
    assert "Install swap-generic, which swaps any per-parameter optimizer" in message
    assert "--find-links dist swap-core swap-generic" in message
    assert "swap_core.register_adapter(SGD, factory, name=...)" in message
    assert "SwapOptimizer(opt, config, adapter_factory)" in message
