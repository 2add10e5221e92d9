"""A DCP load planner that refuses checkpoints holding entries the live state does not have (or another dtype)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .errors import CheckpointMismatchError

__all__ = ["StrictLoadPlanner"]

_SHOWN = 8


class StrictLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that also rejects *extra* FQNs: a checkpoint of another model.

    torch's planner already raises for a missing FQN ("Missing key in checkpoint
    state_dict: ...") and a shape mismatch ("Size mismatch ... for <fqn>"), before
    any tensor is read; entries the loaded state does not ask for it ignores
    silently. This planner raises :class:`~swap_ckpt.errors.CheckpointMismatchError`
    naming them instead. Only entries under the top-level keys being loaded are
    compared, so loading ``{"app": ...}`` from a checkpoint that also holds
    ``"dataloader"`` is fine.

    With ``exact_dtypes=True`` a tensor saved in another dtype than the one it loads
    into is refused too, naming the entries (DCP would cast it silently while reading).
    """

    def __init__(self, *, exact_dtypes: bool = False) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True, allow_partial_load=False)
        self.exact_dtypes = exact_dtypes

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            return
        loaded_roots = {str(key) for key in self.original_state_dict}
        extra = sorted(
            key
            for key in metadata.state_dict_metadata
            if key.split(".", 1)[0] in loaded_roots and key not in self.state_dict
        )
        if extra:
            shown = ", ".join(extra[:_SHOWN]) + (f" and {len(extra) - _SHOWN} more" if len(extra) > _SHOWN else "")
            raise CheckpointMismatchError(
                f"The checkpoint holds {len(extra)} entries the state being loaded does not have "
                f"(a checkpoint of another model?): {shown}"
            )
        if self.exact_dtypes:
            _check_dtypes(self.state_dict, metadata)


def _check_dtypes(state_dict: dict[str, Any], metadata: Metadata) -> None:
    mismatched = []
    for key, value in state_dict.items():
        saved = metadata.state_dict_metadata.get(key)
        if not (isinstance(value, torch.Tensor) and isinstance(saved, TensorStorageMetadata)):
            continue
        if saved.properties.dtype != value.dtype:
            mismatched.append(f"{key} ({saved.properties.dtype} in the checkpoint, {value.dtype} here)")
    if mismatched:
        shown = ", ".join(mismatched[:_SHOWN])
        if len(mismatched) > _SHOWN:
            shown += f" and {len(mismatched) - _SHOWN} more"
        raise CheckpointMismatchError(
            f"The checkpoint holds {len(mismatched)} tensors of another dtype than the state being loaded: "
            f"{shown}. Cast the checkpoint (or the model) first; dcp.load would cast them silently"
        )
