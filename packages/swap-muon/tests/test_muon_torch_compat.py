"""The private torch functions swap-muon relies on (swap_muon.torch_compat) still are torch.optim._muon's."""

from __future__ import annotations

import importlib

import pytest
import torch

from swap_muon.torch_compat import PRIVATE_FUNCTIONS, adjust_lr, muon, zeropower_via_newtonschulz


@pytest.mark.parametrize("name", PRIVATE_FUNCTIONS)
def test_the_fenced_functions_are_torchs_own(name: str) -> None:
    module = importlib.import_module("torch.optim._muon")
    assert callable(getattr(module, name, None)), f"torch.optim._muon.{name} moved"
    fenced = {"muon": muon, "_zeropower_via_newtonschulz": zeropower_via_newtonschulz, "_adjust_lr": adjust_lr}
    assert fenced[name] is getattr(module, name)


def test_newton_schulz_and_the_lr_adjustment_keep_their_signatures() -> None:
    defaults = torch.optim.Muon([torch.nn.Parameter(torch.zeros(4, 4))]).defaults
    update = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    orthogonal = zeropower_via_newtonschulz(update, defaults["ns_coefficients"], defaults["ns_steps"], defaults["eps"])
    assert orthogonal.shape == update.shape and torch.isfinite(orthogonal).all()
    assert isinstance(adjust_lr(0.02, defaults["adjust_lr_fn"], torch.Size([8, 4])), float)
