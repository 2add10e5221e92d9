"""Which parameters Muon should update and which belong to AdamW: the usual recipe, made explicit.

Muon orthogonalizes the update of a weight *matrix* that maps one hidden
representation to another. Embeddings (a lookup table, not a map), the output
head (its rows are per-token logits), norms, biases and anything that is not
2-D are updated better by AdamW, and ``torch.optim.Muon`` refuses non-2-D
parameters outright. The rules, first match wins:

1. ``force_adamw(name)`` -> AdamW; ``force_muon(name)`` -> Muon (a non-2-D one is an error).
2. **embedding**: the weight of an ``nn.Embedding`` / ``nn.EmbeddingBag``, any weight tied
   to one (e.g. a head sharing the embedding matrix), or a name with a component
   containing ``"embed"`` (``tok_embeddings.weight``, ``pos_embed``).
3. **head**: a parameter of a module named ``lm_head``, ``head`` or ``output``. If the
   model has no such module and no head tied to an embedding, the last ``nn.Linear``
   in registration order is taken as the head (``last_linear_is_head=False`` turns this off).
4. **norm**: a parameter of a module whose name or class name contains ``"norm"``.
5. **bias**: a parameter named ``bias`` (or ending in ``_bias``).
6. **not 2-D**: every other parameter with ``ndim != 2``.
7. Everything else, a 2-D hidden matrix, goes to Muon.

Given ``named_parameters()`` pairs instead of a module, rules 2-4 use names only
(no module types, no tying).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Literal

import torch
from torch import nn

__all__ = [
    "HEAD_MODULE_NAMES",
    "NamePredicate",
    "ParamAssignment",
    "assign_muon_params",
    "split_muon_params",
]

HEAD_MODULE_NAMES: frozenset[str] = frozenset({"lm_head", "head", "output"})
"""Names of the module holding the output head (only the module's own name, the last component)."""

NamePredicate = Callable[[str], bool]
"""Called with a parameter's fully qualified name (``"blocks.0.linear1.weight"``)."""

_EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)


@dataclasses.dataclass(frozen=True)
class ParamAssignment:
    """Where one parameter goes and which rule sent it there."""

    name: str
    """The first fully qualified name of the parameter (a tied parameter has several)."""
    param: torch.Tensor
    optimizer: Literal["muon", "adamw"]
    reason: str
    """``"hidden matrix"``, ``"embedding"``, ``"head"``, ``"norm"``, ``"bias"``, ``"not 2-D"`` or ``"override"``."""


@dataclasses.dataclass
class _ParamInfo:
    param: torch.Tensor
    names: list[str]
    modules: list[nn.Module]


def split_muon_params(
    model_or_named_params: nn.Module | Iterable[tuple[str, torch.Tensor]],
    *,
    force_muon: NamePredicate | None = None,
    force_adamw: NamePredicate | None = None,
    last_linear_is_head: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(muon_params, adamw_params)`` of a model, each in parameter order; see the module docstring.

    Every parameter lands in exactly one list (tied parameters once), so the two
    lists can go straight to ``torch.optim.Muon`` and ``torch.optim.AdamW``.
    """
    assignments = assign_muon_params(
        model_or_named_params,
        force_muon=force_muon,
        force_adamw=force_adamw,
        last_linear_is_head=last_linear_is_head,
    )
    muon_params = [item.param for item in assignments if item.optimizer == "muon"]
    adamw_params = [item.param for item in assignments if item.optimizer == "adamw"]
    return muon_params, adamw_params


def assign_muon_params(
    model_or_named_params: nn.Module | Iterable[tuple[str, torch.Tensor]],
    *,
    force_muon: NamePredicate | None = None,
    force_adamw: NamePredicate | None = None,
    last_linear_is_head: bool = True,
) -> list[ParamAssignment]:
    """The assignment of every parameter with the rule that decided it, to log or check a split."""
    if isinstance(model_or_named_params, nn.Module):
        infos = _module_params(model_or_named_params)
        head_ids = _head_param_ids(model_or_named_params, infos, last_linear_is_head)
    else:
        infos = _named_params(model_or_named_params)
        head_ids = set()
    assignments = []
    for info in infos:
        optimizer, reason = _assign(info, head_ids, force_muon, force_adamw)
        assignments.append(ParamAssignment(info.names[0], info.param, optimizer, reason))
    return assignments


def _assign(
    info: _ParamInfo,
    head_ids: set[int],
    force_muon: NamePredicate | None,
    force_adamw: NamePredicate | None,
) -> tuple[Literal["muon", "adamw"], str]:
    forced_muon = force_muon is not None and any(force_muon(name) for name in info.names)
    forced_adamw = force_adamw is not None and any(force_adamw(name) for name in info.names)
    shape = tuple(info.param.shape)
    if forced_muon and forced_adamw:
        raise ValueError(f"Parameter {info.names[0]!r} is selected by both force_muon and force_adamw")
    if forced_adamw:
        return "adamw", "override"
    if forced_muon:
        if info.param.ndim != 2:
            raise ValueError(
                f"force_muon selected parameter {info.names[0]!r} of shape {shape}, "
                "but Muon only supports 2-D parameters"
            )
        return "muon", "override"
    if _is_embedding(info):
        return "adamw", "embedding"
    if id(info.param) in head_ids or any(_owner_name(name) in HEAD_MODULE_NAMES for name in info.names):
        return "adamw", "head"
    if _is_norm(info):
        return "adamw", "norm"
    if any(_is_bias_name(name) for name in info.names):
        return "adamw", "bias"
    if info.param.ndim != 2:
        return "adamw", "not 2-D"
    return "muon", "hidden matrix"


# -- collecting parameters ------------------------------------------------------------
def _module_params(model: nn.Module) -> list[_ParamInfo]:
    """Every distinct parameter with all its names and owning modules, in ``parameters()`` order."""
    by_id: dict[int, _ParamInfo] = {}
    for name, param in model.named_parameters():
        by_id[id(param)] = _ParamInfo(param, [name], [])
    # Tied parameters and shared modules appear once in named_parameters(); collect every alias.
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False):
            info = by_id[id(param)]
            qualified = f"{module_name}.{param_name}" if module_name else param_name
            if qualified not in info.names:
                info.names.append(qualified)
            info.modules.append(module)
    return list(by_id.values())


def _named_params(named_params: Iterable[tuple[str, torch.Tensor]]) -> list[_ParamInfo]:
    by_id: dict[int, _ParamInfo] = {}
    for item in named_params:
        # Checked at runtime: a list of bare parameters is the likely mistake.
        checked: object = item
        if not (isinstance(checked, tuple) and len(checked) == 2 and isinstance(checked[0], str)):
            raise TypeError(f"Expected (name, parameter) pairs such as model.named_parameters(), got {item!r}")
        name, param = item
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"Parameter {name!r} is a {type(param).__name__}, not a tensor")
        info = by_id.setdefault(id(param), _ParamInfo(param, [], []))
        if name not in info.names:
            info.names.append(name)
    return list(by_id.values())


def _head_param_ids(model: nn.Module, infos: list[_ParamInfo], last_linear_is_head: bool) -> set[int]:
    """Parameters of the last ``nn.Linear``, unless the model names or ties its head already."""
    named_head = any(_owner_name(name) in HEAD_MODULE_NAMES for info in infos for name in info.names)
    tied_head = any(_is_embedding(info) and _has_linear(info) for info in infos)
    if named_head or tied_head or not last_linear_is_head:
        return set()
    last_linear = None
    for module in model.modules():
        if isinstance(module, nn.Linear):
            last_linear = module
    if last_linear is None:
        return set()
    return {id(param) for param in last_linear.parameters(recurse=False)}


# -- rules ----------------------------------------------------------------------------
def _is_embedding(info: _ParamInfo) -> bool:
    if any(isinstance(module, _EMBEDDING_TYPES) for module in info.modules):
        return True
    return any("embed" in component.lower() for name in info.names for component in name.split("."))


def _has_linear(info: _ParamInfo) -> bool:
    return any(isinstance(module, nn.Linear) for module in info.modules)


def _is_norm(info: _ParamInfo) -> bool:
    if any("norm" in type(module).__name__.lower() for module in info.modules):
        return True
    return any("norm" in _owner_name(name).lower() for name in info.names)


def _is_bias_name(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf == "bias" or leaf.endswith("_bias")


def _owner_name(name: str) -> str:
    """The name of the module that holds parameter ``name`` (``""`` for the root)."""
    parts = name.split(".")
    return parts[-2] if len(parts) > 1 else ""
