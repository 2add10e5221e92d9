"""Each private torch API swap-generic relies on (swap_generic.torch_compat) still is where it was checked."""

from __future__ import annotations

import torch

from swap_generic.torch_compat import unhooked_step


def _sgd() -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)


def test_unhooked_step_is_the_function_below_torchs_hook_wrapper() -> None:
    optimizer = _sgd()
    assert getattr(torch.optim.SGD.step, "hooked", False), "torch no longer marks the hooked step"
    calls: list[str] = []
    optimizer.register_step_pre_hook(lambda *_: calls.append("pre"))
    optimizer.param_groups[0]["params"][0].grad = torch.ones(3)
    unhooked_step(optimizer)()
    assert calls == [], "the unhooked step ran the step hooks"
    assert torch.equal(optimizer.param_groups[0]["params"][0].detach(), torch.full((3,), 0.9))
    optimizer.step()
    assert calls == ["pre"]
