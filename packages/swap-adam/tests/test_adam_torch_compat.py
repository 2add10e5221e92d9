"""The private torch helpers swap-adam relies on (swap_adam.torch_compat) still are where, and what, they were."""

from __future__ import annotations

import pytest
import torch
import torch.optim.optimizer as torch_optimizer

from swap_adam.torch_compat import (
    PRIVATE_HELPERS,
    default_to_fused_or_foreach,
    device_dtype_check_for_fused,
    get_scalar_dtype,
)


@pytest.mark.parametrize("name", PRIVATE_HELPERS)
def test_the_private_helpers_are_torchs_own(name: str) -> None:
    assert callable(getattr(torch_optimizer, name, None)), f"torch.optim.optimizer.{name} moved"


def test_the_helpers_decide_as_adam_step_does_on_the_cpu() -> None:
    params = [torch.zeros(3)]
    assert default_to_fused_or_foreach(params, False, use_fused=False) == (False, False)  # CPU: single-tensor
    assert get_scalar_dtype() == torch.float32
    assert get_scalar_dtype(is_fused=True) == torch.float32
    device_dtype_check_for_fused(torch.zeros(3))  # float32 on the CPU: fused Adam supports it
    with pytest.raises(RuntimeError, match="fused"):
        device_dtype_check_for_fused(torch.zeros(3, dtype=torch.int64))
