"""The probe's sandbox: twins of an optimizer that share nothing mutable with it.

The wrap-time probe steps twins of the optimizer on stand-in parameters. A twin that shared the optimizer's mutable
attributes (a counter in ``defaults``, a schedule dict saved in its ``state_dict()``, a logging counter) would change
the optimizer it probes. So a twin is a deep copy of everything reachable from the optimizer's attributes, through
one ``copy.deepcopy`` memo that maps:

- the optimizer itself to the twin (a bound method or a schedule that points back at it points at the twin);
- its ``state`` to the twin's own empty state, its ``param_groups`` list and each group dict to the twin's, and each
  group's ``"params"`` list to the twin's (the stand-ins in the probed group, empty lists in the others);
- each of its parameters and each tensor of its states, wherever else it is reached (an attribute, a dict keyed by
  parameters, an inner object), to a meta tensor of its shape and dtype, made on first reach: no real value is
  copied, and nothing the twin runs can write to it.

Every other value is deep-copied. An attribute or group value that cannot be (it holds a lock, a process group) is
shared whole, as locks and process groups are no values a step advances; so are the hooks and method redirects a
``SwapOptimizer`` installed on the optimizer it wraps (a re-probe after wrapping: a twin runs no hook, and copying
them would copy the adapter and its host memory). What a sandbox cannot reach: class
attributes, globals, and the cells of closures (a function is copied as itself).
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections import defaultdict
from typing import Any

import torch

from .delegation import swap_machinery

__all__ = ["Sandbox"]

_OWN_ATTRIBUTES = ("param_groups", "state")
"""Attributes a twin gets its own of, not copies."""


class _PlaceholderMemo(dict[int, Any]):
    """A ``copy.deepcopy`` memo that maps the optimizer's own tensors (by id) to meta placeholders, made when the copy
    first reaches them (``copy.deepcopy`` looks every object up with ``memo.get``)."""

    def __init__(self, originals: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self._originals = originals

    def get(self, key: int, default: Any = None) -> Any:
        if key in self:
            return self[key]
        original = self._originals.get(key)
        if original is None:
            return default
        placeholder = _placeholder(original)
        self[key] = placeholder
        return placeholder


def _placeholder(original: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``original``'s shape and dtype (a parameter where it is one)."""
    placeholder = torch.empty(tuple(original.shape), dtype=original.dtype, device="meta")
    if isinstance(original, torch.nn.Parameter):
        return torch.nn.Parameter(placeholder, requires_grad=original.requires_grad)
    return placeholder


class Sandbox:
    """Makes twins of ``optimizer`` that share nothing mutable with it (see the module's docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        originals: dict[int, torch.Tensor] = {}
        for group in optimizer.param_groups:
            originals.update((id(param), param) for param in group["params"])
        for state in optimizer.state.values():
            if isinstance(state, dict):
                originals.update((id(value), value) for value in state.values() if isinstance(value, torch.Tensor))
        self._originals = originals
        self._shared = {id(value): value for value in _installed_by_swap(optimizer)}

    def twin(self, index: int, standins: list[torch.Tensor], *, constructed: bool) -> torch.optim.Optimizer | None:
        """A twin over ``standins`` in group ``index`` (every other group empty): a deep copy of the optimizer with
        an empty state of its own; or (``constructed``) one built by the optimizer's constructor from copies of its
        defaults, for a class whose constructor makes states (Adagrad's ``sum``). ``None`` when that cannot be
        built."""
        memo = _PlaceholderMemo(self._originals)
        memo.update(self._shared)  # deepcopy takes what the memo maps an object to: these stay themselves
        if constructed:
            return self._constructed(self._groups(index, standins, memo), memo)
        optimizer = self.optimizer
        twin = object.__new__(type(optimizer))
        memo[id(optimizer)] = twin
        twin.state = memo[id(optimizer.state)] = defaultdict(dict)
        twin.param_groups = self._groups(index, standins, memo)
        twin.__dict__.update(
            (name, _deep_copy(value, memo)) for name, value in vars(optimizer).items() if name not in _OWN_ATTRIBUTES
        )
        return twin

    def _groups(self, index: int, standins: list[torch.Tensor], memo: dict[int, Any]) -> list[dict[str, Any]]:
        """Copies of the optimizer's param groups, ``standins`` in group ``index`` and no parameter in the others."""
        groups: list[dict[str, Any]] = []
        memo[id(self.optimizer.param_groups)] = groups
        for position, group in enumerate(self.optimizer.param_groups):
            copied: dict[str, Any] = {}
            memo[id(group)] = copied
            memo[id(group["params"])] = copied["params"] = list(standins) if position == index else []
            groups.append(copied)
        for group, copied in zip(self.optimizer.param_groups, groups, strict=True):
            copied.update((key, _deep_copy(value, memo)) for key, value in group.items() if key != "params")
        return groups

    def _constructed(self, groups: list[dict[str, Any]], memo: dict[int, Any]) -> torch.optim.Optimizer | None:
        """``type(optimizer)(groups, **copies of its defaults that the constructor takes)``, or ``None`` where that
        fails."""
        cls = type(self.optimizer)
        try:
            parameters = inspect.signature(cls.__init__).parameters
        except (TypeError, ValueError):
            return None
        kwargs: dict[str, Any] = {}
        for name, parameter in list(parameters.items())[2:]:  # self, params
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                continue
            if name in self.optimizer.defaults:
                kwargs[name] = _deep_copy(self.optimizer.defaults[name], memo)
            elif parameter.default is parameter.empty:
                return None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return cls(groups, **kwargs)
        except KeyboardInterrupt:
            raise
        except BaseException:  # a constructor that cannot take stand-ins: the probe says it could not tell
            return None


def _installed_by_swap(optimizer: torch.optim.Optimizer) -> list[Any]:
    """The hooks (in torch's hook dicts) and method redirects a ``SwapOptimizer`` installed on ``optimizer``."""
    found: list[Any] = []
    for name, value in vars(optimizer).items():
        if name in _OWN_ATTRIBUTES:
            continue
        if swap_machinery(value):
            found.append(value)
        elif name.startswith("_optimizer_") and name.endswith("_hooks") and isinstance(value, dict):
            found.extend(hook for hook in value.values() if swap_machinery(hook))
    return found


def _deep_copy(value: Any, memo: dict[int, Any]) -> Any:
    try:
        return copy.deepcopy(value, memo)
    except KeyboardInterrupt:
        raise
    except BaseException:  # a lock, a process group, a stream: not a value a step advances
        return value
