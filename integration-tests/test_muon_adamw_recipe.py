"""The Muon + AdamW recipe with both optimizers swapped trains bitwise like the two plain optimizers.

Cross-package on purpose: swap-muon's split and adapter next to swap-adam's AdamW
adapter, both found through the ``swap_core.adapters`` entry point, sharing one
device backend. Skipped when swap-adam is not installed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal
from swap_core.testing.pytest_plugin import BackendFactory
from swap_muon import MuonAdapter, split_muon_params

swap_adam = pytest.importorskip("swap_adam")

VOCAB, WIDTH, HEADS, CONTEXT, BATCH_SIZE, STEPS = 24, 16, 2, 8, 4, 4


class CharTransformer(nn.Module):
    """A tiny causal transformer: embeddings, two pre-norm blocks, a final norm and an ``lm_head``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, WIDTH)
        self.pos_embeddings = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(2)
        )
        self.final_norm = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(length, device=tokens.device))
        for block in self.blocks:
            hidden = block(hidden, src_mask=causal, is_causal=True)
        logits: torch.Tensor = self.lm_head(self.final_norm(hidden))
        return logits


def make_optimizers(model: nn.Module) -> tuple[torch.optim.Muon, torch.optim.AdamW]:
    muon_params, adamw_params = split_muon_params(model)
    return (
        torch.optim.Muon(muon_params, lr=2e-2, weight_decay=0.01),
        torch.optim.AdamW(adamw_params, lr=3e-3, weight_decay=0.01),
    )


def train_step(model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH_SIZE, CONTEXT + 1), generator=generator)
    device = next(model.parameters()).device
    inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    for optimizer in optimizers:
        optimizer.step()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_muon_and_adamw_both_swapped_match_the_plain_pair(packed: bool, swap_backend_factory: BackendFactory) -> None:
    backend = swap_backend_factory(mode="random", seed=4)
    torch.manual_seed(0)
    reference_model = CharTransformer().to(backend.device)
    swapped_model = CharTransformer().to(backend.device)
    swapped_model.load_state_dict(reference_model.state_dict())

    reference = make_optimizers(reference_model)
    # min_numel=64: matrices and embeddings swap, the 16-element norm and bias states stay resident.
    config = SwapConfig(backend=backend, swap_times=3, min_numel=64, packed=packed)
    swapped = tuple(swap_optimizer(optimizer, config) for optimizer in make_optimizers(swapped_model))
    assert isinstance(swapped[0].adapter, MuonAdapter)
    assert isinstance(swapped[1].adapter, swap_adam.AdamAdapter)

    for step in range(STEPS):
        train_step(reference_model, reference, step)
        train_step(swapped_model, swapped, step)
        for (name, expected), actual in zip(
            reference_model.named_parameters(), swapped_model.parameters(), strict=True
        ):
            assert_bitwise_equal(expected, actual, f"step {step}: {name}")
    for plain, wrapped in zip(reference, swapped, strict=True):
        assert_state_dicts_equal(plain.state_dict(), wrapped.state_dict(), type(plain).__name__)
    for optimizer in swapped:
        assert isinstance(optimizer, SwapOptimizer)
        assert optimizer.stats.h2d_bytes > 0, f"{type(optimizer.optimizer).__name__} swapped nothing"
    assert not getattr(backend, "races", [])
