"""Which adapter serves which optimizer: explicit registrations plus installed plugins.

swap-core never imports a family package. Families announce themselves through
the ``swap_core.adapters`` entry-point group (``adam = "swap_adam:register"``);
the registry loads them lazily, on the first lookup, so ``import swap_core``
stays cheap and a broken plugin cannot break code that never needs it. A plugin
that fails to load is a warning until its adapter is needed, then an error that
names it; ``SWAP_STRICT_PLUGINS=1`` turns every failure into an error at once.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import threading
import warnings
from collections.abc import Callable, Iterable

import torch

from swap_core.adapters.base import ADAPTER_API_VERSION, AdapterFactory
from swap_core.errors import (
    AdapterLoadError,
    AdapterLoadWarning,
    AdapterNotFoundError,
    AdapterVersionError,
    DuplicateAdapterError,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "STRICT_PLUGINS_ENV",
    "AdapterRegistry",
    "default_registry",
    "register_adapter",
]

ENTRY_POINT_GROUP = "swap_core.adapters"
"""The entry-point group family packages register in (``name = "module:register"``)."""

STRICT_PLUGINS_ENV = "SWAP_STRICT_PLUGINS"
"""Set to ``1`` to raise :class:`AdapterLoadError` as soon as any plugin fails to load."""

_FAMILY_PACKAGES: tuple[tuple[str, str], ...] = (
    ("Adam", "swap-adam"),
    ("AdamW", "swap-adam"),
    ("Muon", "swap-muon"),
)
"""``torch.optim`` class name -> the package whose plugin adapts that family (used in error hints)."""

GENERIC_PACKAGE = "swap-generic"
"""The package whose plugin serves every optimizer without a dedicated family (named in error hints)."""

EntryPointSource = Callable[[], Iterable[importlib.metadata.EntryPoint]]


@dataclasses.dataclass(frozen=True)
class _Registration:
    optimizer_cls: type[torch.optim.Optimizer]
    factory: AdapterFactory
    name: str


@dataclasses.dataclass(frozen=True)
class _PluginFailure:
    entry_point: importlib.metadata.EntryPoint
    error: BaseException

    def describe(self) -> str:
        return f"{self.entry_point.name!r} ({self.entry_point.value}): {type(self.error).__name__}: {self.error}"


class AdapterRegistry:
    """Maps optimizer classes to adapter factories; resolution follows the optimizer's MRO.

    ``entry_points`` replaces the installed-plugin source (tests inject their own);
    by default it is ``importlib.metadata.entry_points(group=group)``.
    """

    api_version: int = ADAPTER_API_VERSION
    """The adapter API version plugins must be written for."""

    def __init__(self, group: str = ENTRY_POINT_GROUP, entry_points: EntryPointSource | None = None) -> None:
        self.group = group
        self._entry_points = entry_points if entry_points is not None else _installed_entry_points(group)
        self._by_class: dict[type[torch.optim.Optimizer], _Registration] = {}
        self._by_name: dict[str, _Registration] = {}
        self._failures: list[_PluginFailure] = []
        self._discovered = False
        # Re-entrant: a plugin's register() runs under the lock and calls register().
        self._lock = threading.RLock()

    def register(
        self,
        optimizer_cls: type[torch.optim.Optimizer],
        factory: AdapterFactory,
        *,
        name: str,
        api_version: int = ADAPTER_API_VERSION,
        replace: bool = False,
    ) -> None:
        """Serve ``optimizer_cls`` (and its subclasses) with ``factory``.

        Installed plugins are loaded first, so a clash with one of them is reported
        here, where ``replace=True`` can settle it, not later as a plugin warning.
        Registering the identical ``(optimizer_cls, factory, name)`` again is a no-op.
        """
        _check_registration(optimizer_cls, factory, name)
        if api_version != ADAPTER_API_VERSION:
            raise AdapterVersionError(
                f"Adapter {name!r} for {_qualname(optimizer_cls)} targets adapter API version {api_version}, "
                f"but this swap-core supports version {ADAPTER_API_VERSION}; "
                "install a release of the adapter package built for this swap-core."
            )
        registration = _Registration(optimizer_cls, factory, name)
        with self._lock:
            self._discover()
            if not replace:
                self._check_duplicates(registration)
            self._unregister(self._by_class.get(optimizer_cls))
            self._unregister(self._by_name.get(name))
            self._by_class[optimizer_cls] = registration
            self._by_name[name] = registration

    def resolve(self, optimizer: torch.optim.Optimizer) -> AdapterFactory:
        """The factory registered for the nearest class in ``type(optimizer).__mro__``."""
        optimizer_cls = type(optimizer)
        with self._lock:
            self._discover()
            self._raise_if_strict()
            for cls in optimizer_cls.__mro__:
                registration = self._by_class.get(cls)
                if registration is not None:
                    return registration.factory
            raise self._miss_error(optimizer_cls)

    def registered(self) -> dict[str, type[torch.optim.Optimizer]]:
        """Adapter name -> the optimizer class it serves, sorted by name."""
        with self._lock:
            self._discover()
            self._raise_if_strict()
            return {name: self._by_name[name].optimizer_cls for name in sorted(self._by_name)}

    # -- discovery -------------------------------------------------------------
    def _discover(self) -> None:
        """Load every plugin once, then fail in strict mode.

        The flag is set first: a plugin's ``register()`` calls back into this
        registry, and must neither reload plugins nor trip over the strict check.
        """
        if self._discovered:
            return
        self._discovered = True
        for entry_point in self._entry_points():
            self._load_plugin(entry_point)
        self._raise_if_strict()

    def _load_plugin(self, entry_point: importlib.metadata.EntryPoint) -> None:
        try:
            register = entry_point.load()
            if not callable(register):
                kind = type(register).__name__
                raise TypeError(f"{entry_point.value} must be a register(registry) function, got {kind}")
            register(self)
        except Exception as error:
            failure = _PluginFailure(entry_point, error)
            self._failures.append(failure)
            if not _strict_plugins():
                warnings.warn(
                    AdapterLoadWarning(
                        f"swap adapter plugin {failure.describe()}. Its adapters are unavailable; this becomes an "
                        f"error only if one of them is needed (set {STRICT_PLUGINS_ENV}=1 to fail at once)."
                    ),
                    stacklevel=4,  # the code that called resolve(), registered() or register()
                )

    def _raise_if_strict(self) -> None:
        if self._failures and _strict_plugins():
            raise _load_error(self._failures) from self._failures[0].error

    # -- bookkeeping -----------------------------------------------------------
    def _check_duplicates(self, new: _Registration) -> None:
        by_class = self._by_class.get(new.optimizer_cls)
        if by_class is not None and by_class != new:
            raise DuplicateAdapterError(
                f"{_qualname(new.optimizer_cls)} already has adapter {by_class.name!r} "
                f"(factory {_qualname(by_class.factory)}); cannot also register adapter {new.name!r} "
                f"(factory {_qualname(new.factory)}) for it. Pass replace=True to override."
            )
        by_name = self._by_name.get(new.name)
        if by_name is not None and by_name != new:
            raise DuplicateAdapterError(
                f"Adapter name {new.name!r} is already registered for {_qualname(by_name.optimizer_cls)}; "
                f"cannot register it for {_qualname(new.optimizer_cls)}. Choose another name or pass replace=True."
            )

    def _unregister(self, registration: _Registration | None) -> None:
        if registration is not None:
            del self._by_class[registration.optimizer_cls]
            del self._by_name[registration.name]

    def _miss_error(self, optimizer_cls: type[torch.optim.Optimizer]) -> AdapterLoadError | AdapterNotFoundError:
        """A broken plugin may be the one that would have served this optimizer, so it is named first."""
        if self._failures:
            return _load_error(self._failures, missing=optimizer_cls)
        listing = ", ".join(f"{name!r} -> {_qualname(cls)}" for name, cls in self.registered().items())
        return AdapterNotFoundError(
            f"No swap adapter is registered for {_qualname(optimizer_cls)} or any of its base classes. "
            f"Registered adapters: {listing or 'none'}. {_how_to_get_adapter(optimizer_cls)}"
        )


def _installed_entry_points(group: str) -> EntryPointSource:
    def entry_points() -> Iterable[importlib.metadata.EntryPoint]:
        return importlib.metadata.entry_points(group=group)

    return entry_points


def _check_registration(optimizer_cls: object, factory: object, name: object) -> None:
    if not isinstance(name, str):
        raise TypeError(f"Adapter name must be a str, got {type(name).__name__}: {name!r}")
    if not name.strip():
        raise ValueError(f"Adapter name must be a non-empty string, got {name!r}")
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"Adapter {name!r}: expected a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
    if not callable(factory):
        raise TypeError(f"Adapter {name!r}: factory must be callable (optimizer -> adapter), got {factory!r}")


def _strict_plugins() -> bool:
    return os.environ.get(STRICT_PLUGINS_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _load_error(failures: list[_PluginFailure], missing: type[torch.optim.Optimizer] | None = None) -> AdapterLoadError:
    broken = "; ".join(failure.describe() for failure in failures)
    needed = f"No swap adapter is registered for {_qualname(missing)}, and " if missing is not None else ""
    return AdapterLoadError(
        f"{needed}{len(failures)} swap adapter plugin(s) failed to load: {broken}. "
        "Reinstall or upgrade the named package(s) so that they match this swap-core."
    )


def _how_to_get_adapter(optimizer_cls: type[torch.optim.Optimizer]) -> str:
    explicit = (
        f"Register one with swap_core.register_adapter({optimizer_cls.__name__}, factory, name=...) "
        "or pass it explicitly: SwapOptimizer(opt, config, adapter_factory)."
    )
    for torch_name, package in _FAMILY_PACKAGES:
        family = getattr(torch.optim, torch_name, None)
        if isinstance(family, type) and issubclass(optimizer_cls, family):
            return f"Install the adapter package for this family: {_install(package)}. Or: {explicit}"
    return (
        f"Install {GENERIC_PACKAGE}, which swaps any per-parameter optimizer by running its own step batch by "
        f"batch: {_install(GENERIC_PACKAGE)}. Or: {explicit}"
    )


def _install(package: str) -> str:
    """How to install ``package`` today (not on PyPI yet: from the repository or the built wheels)."""
    return (
        f"python3 -m pip install ./packages/swap-core ./packages/{package} from a clone of the repository, or "
        f"python3 -m pip install --find-links dist swap-core {package} from its built wheels (docs/index.md, "
        "'Install')"
    )


def _qualname(obj: object) -> str:
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or repr(obj)
    return f"{module}.{name}" if module else name


default_registry = AdapterRegistry()
"""The registry :func:`swap_core.swap_optimizer` resolves adapters from."""


def register_adapter(
    optimizer_cls: type[torch.optim.Optimizer],
    factory: AdapterFactory,
    *,
    name: str,
    replace: bool = False,
) -> None:
    """Register ``factory`` for ``optimizer_cls`` (and its subclasses) in :data:`default_registry`."""
    default_registry.register(optimizer_cls, factory, name=name, replace=replace)
