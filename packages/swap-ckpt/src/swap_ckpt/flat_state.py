"""Nesting a flattened optimizer state dict by the keys it holds, not by the live optimizer's keys.

With ``StateDictOptions(flatten_optimizer_state_dict=True)`` torch stores optimizer
state as ``state.<fqn>.<key>`` and ``param_groups.<fqn>.<option>`` entries. Its
own unflattening (in ``set_optimizer_state_dict``) looks up only the keys the
*live* optimizer already holds for each parameter. That loses entries whenever
the live layout differs from the checkpoint layout: a distributed Muon rank
holds no momentum for matrices it does not own, yet the checkpoint holds its
shard of every momentum. :func:`nest_flat_optimizer_state` rebuilds torch's
nested form from the checkpoint's own keys instead; ``set_state_dict`` accepts
it as it accepts any nested state dict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["is_flat_optimizer_state", "nest_flat_optimizer_state"]

_STATE = "state."
_GROUPS = "param_groups."


def is_flat_optimizer_state(optim_state: Mapping[str, Any]) -> bool:
    """Whether ``optim_state`` is torch's flattened form (no top-level ``"state"`` entry)."""
    return "state" not in optim_state and any(key.startswith(_GROUPS) for key in optim_state)


def nest_flat_optimizer_state(
    optim_state: Mapping[str, Any], optimizers: Sequence[torch.optim.Optimizer]
) -> dict[str, Any]:
    """``{"state": {fqn: {...}}, "param_groups": [...]}`` holding every entry of the flattened ``optim_state``.

    Each FQN gets a param group of its own carrying its saved options: torch's loader pairs live
    groups with saved ones by FQN, so the grouping itself need not be recovered.
    """
    options = {key for optimizer in optimizers for group in optimizer.param_groups for key in group} - {"params"}
    groups: dict[str, dict[str, Any]] = {}
    for key, value in optim_state.items():
        if not key.startswith(_GROUPS):
            continue
        fqn, _, option = key[len(_GROUPS) :].rpartition(".")
        if option not in options or not fqn:
            raise ValueError(
                f"Flattened optimizer state entry {key!r} names no option of the optimizers {sorted(options)}"
            )
        groups.setdefault(fqn, {"params": [fqn]})[option] = value
    by_length = sorted(groups, key=len, reverse=True)  # "a.b" before "a": the longest FQN that prefixes wins
    # Every parameter gets an entry, possibly empty, as torch's own unflattening gives it.
    state: dict[str, dict[str, Any]] = {fqn: {} for fqn in groups}
    for key, value in optim_state.items():
        if not key.startswith(_STATE):
            continue
        rest = key[len(_STATE) :]
        param_fqn = next((name for name in by_length if rest.startswith(name + ".")), None)
        if param_fqn is None:
            raise ValueError(f"Flattened optimizer state entry {key!r} belongs to no parameter of the param groups")
        *path, leaf = rest[len(param_fqn) + 1 :].split(".")
        entry = state[param_fqn]
        for part in path:  # nested state values were flattened with dots too
            entry = entry.setdefault(part, {})
        entry[leaf] = value
    unknown = sorted(key for key in optim_state if not key.startswith((_STATE, _GROUPS)))
    if unknown:
        raise ValueError(f"Flattened optimizer state has entries that are neither state nor options: {unknown[:8]}")
    return {"state": state, "param_groups": list(groups.values())}
