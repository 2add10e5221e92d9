"""A DCP load planner that refuses checkpoints holding entries the live state does not have."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

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
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True, allow_partial_load=False)

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
