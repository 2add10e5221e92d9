"""Root conftest of the swap monorepo: loads the shared pytest plugin for every test suite, and gives the Python
snippets of README.md and docs/ what they take as given when ``nox -s docs_snippets`` runs them."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = ("swap_core.testing.pytest_plugin",)

# Hypothesis' wall-clock checks (a deadline per example, "input generation is slow") depend on the machine's load:
# under pytest-xdist beside a CPU-bound test they fail tests that are correct. No pass/fail test here times anything.
settings.register_profile("swap", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("swap")


@pytest.hookimpl(optionalhook=True)  # pytest-markdown-docs' hook: only the docs_snippets session installs it
def pytest_markdown_docs_globals() -> dict[str, Any]:
    """The names the docs' snippets use without defining them (``model``, ``params``, ``loader``...): small
    stand-ins on the CPU, made afresh for every snippet, so each runs as written (pytest-markdown-docs)."""
    import os
    import socket
    import tempfile

    import torch
    from torch import nn

    from swap_core import SwapConfig, swap_optimizer

    class DocsModel(nn.Module):
        """Two hidden blocks and a head: what ``build_model()`` returns in the docs."""

        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(2)])
            self.head = nn.Linear(32, 10)

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                inputs = block(inputs)
            return self.head(inputs)

    def compute_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(model(inputs.to(torch.get_default_dtype())), targets)

    generator = torch.Generator().manual_seed(0)
    model = DocsModel()
    params = [nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((64, 64), (64,))]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
    from swap_muon import split_muon_params

    muon_params, adamw_params = split_muon_params(model)
    sim = SwapConfig(backend="sim")
    with socket.socket() as probe:  # a single-rank process group for the snippets that start one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    return {
        "torch": torch,
        "nn": nn,
        "SwapConfig": SwapConfig,
        "swap_optimizer": swap_optimizer,
        "build_model": DocsModel,
        "model": model,
        "device": torch.device("cpu"),
        "params": params,
        "hidden_matrices": [param for param in model.parameters() if param.ndim == 2],
        "loader": [(torch.randn(8, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator))],
        "compute_loss": compute_loss,
        "muon": swap_optimizer(torch.optim.Muon(muon_params, lr=0.02), sim),
        "adamw": swap_optimizer(torch.optim.AdamW(adamw_params, lr=3e-3), sim),
        "opt": swap_optimizer(torch.optim.AdamW(DocsModel().parameters()), sim),
        "path": tempfile.mkdtemp(prefix="swap-docs-"),
    }
