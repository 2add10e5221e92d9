"""The private torch APIs swap-ckpt relies on, fenced in one module.

``torch.utils._pytree`` walks nested state dicts (torch's own DCP state-dict helpers use it for
the same purpose); it has no public equivalent in torch 2.13. Checked against torch 2.13.0.
"""

from __future__ import annotations

from torch.utils._pytree import tree_leaves, tree_map_only

__all__ = ["tree_leaves", "tree_map_only"]
