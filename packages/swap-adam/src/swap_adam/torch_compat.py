"""The private torch APIs swap-adam relies on, fenced in one module.

``AdamAdapter`` runs torch's own Adam (``torch.optim.adam.adam``, public) with the arguments
``Adam.step`` passes, and decides them as ``Adam.step`` does, with three helpers of
``torch.optim.optimizer`` that have no public equivalent: the foreach/fused default, the fused
device and dtype check, and the dtype of the ``step`` counter. Checked against torch 2.13.0; when
torch moves one, importing swap-adam raises :class:`~swap_core.torch_compat.TorchCompatError`
naming it (``tests/test_adam_torch_compat.py``).
"""

from __future__ import annotations

from swap_core.torch_compat import private_function

__all__ = ["PRIVATE_HELPERS", "default_to_fused_or_foreach", "device_dtype_check_for_fused", "get_scalar_dtype"]

PRIVATE_HELPERS = ("_default_to_fused_or_foreach", "_device_dtype_check_for_fused", "_get_scalar_dtype")
"""The functions of ``torch.optim.optimizer`` used (checked: torch 2.13)."""

_MODULE = "torch.optim.optimizer"
_USER = "swap-adam calls to decide Adam's arguments"

default_to_fused_or_foreach = private_function(_MODULE, "_default_to_fused_or_foreach", user=_USER)
"""``(tensors, differentiable, use_fused) -> (fused, foreach)``: torch's default implementation choice."""

device_dtype_check_for_fused = private_function(_MODULE, "_device_dtype_check_for_fused", user=_USER)
"""Raises as ``Adam(fused=True)`` does for a parameter the fused kernel does not support."""

get_scalar_dtype = private_function(_MODULE, "_get_scalar_dtype", user=_USER)
"""The dtype torch gives the ``step`` counter (``is_fused=...``)."""
