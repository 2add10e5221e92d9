"""PyTorch Lightning: a swapped AdamW from ``configure_optimizers`` trains and resumes bitwise as plain AdamW does.

The recipe is examples/integrations/lightning_module.py. Runs in ``nox -s integrations``
(pytorch-lightning installed); skipped elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from swap_core import SwapConfig, SwapOptimizer
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

pl = pytest.importorskip("pytorch_lightning")

from lightning_module import SwappedAdamWRegression  # noqa: E402

STEPS, SAVE_AT, BATCHES_PER_EPOCH = 6, 3, 3
"""The stop falls on an epoch's end, where Lightning resumes a plain DataLoader without a warning."""


class PlainAdamWRegression(SwappedAdamWRegression):
    """The same module with the unwrapped AdamW: the reference."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _data() -> torch.utils.data.DataLoader[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(8 * BATCHES_PER_EPOCH, 16, generator=generator)
    dataset = torch.utils.data.TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).sin())
    return torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=False)


def _module(cls: type[SwappedAdamWRegression], seed: int) -> SwappedAdamWRegression:
    torch.manual_seed(0)
    return cls(swap=SwapConfig(backend=SimBackend(mode="random", seed=seed), swap_times=3, min_numel=64))


def _trainer(max_steps: int, directory: Path) -> Any:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        default_root_dir=directory,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _assert_equal(expected: SwappedAdamWRegression, actual: SwappedAdamWRegression, where: str) -> None:
    actual_params = dict(actual.named_parameters())
    for name, param in expected.named_parameters():
        assert_bitwise_equal(param, actual_params[name], f"{where}: {name}")


def _stop_and_resume(cls: type[SwappedAdamWRegression], directory: Path) -> tuple[SwappedAdamWRegression, Any, Any]:
    """Train to SAVE_AT, save a Lightning checkpoint, resume it in a new Trainer and module up to STEPS."""
    first = _module(cls, seed=4)
    first_trainer = _trainer(SAVE_AT, directory)
    first_trainer.fit(first, _data())
    checkpoint = directory / "stopped.ckpt"
    first_trainer.save_checkpoint(checkpoint)
    saved = torch.load(checkpoint, weights_only=False)["optimizer_states"][0]
    resumed = _module(cls, seed=5)
    resumed_trainer = _trainer(STEPS, directory)
    resumed_trainer.fit(resumed, _data(), ckpt_path=checkpoint)
    assert resumed_trainer.global_step == STEPS
    return resumed, resumed_trainer.optimizers[0], saved


def test_configure_optimizers_trains_bitwise(tmp_path: Path) -> None:
    plain = _module(PlainAdamWRegression, seed=0)
    plain_trainer = _trainer(STEPS, tmp_path)
    plain_trainer.fit(plain, _data())

    swapped = _module(SwappedAdamWRegression, seed=3)
    trainer = _trainer(STEPS, tmp_path)
    trainer.fit(swapped, _data())
    (optimizer,) = trainer.optimizers
    assert isinstance(optimizer, SwapOptimizer) and optimizer.stats.h2d_bytes > 0
    _assert_equal(plain, swapped, "swapped vs plain")
    assert_state_dicts_equal(plain_trainer.optimizers[0].state_dict(), optimizer.state_dict(), "optimizer")


def test_a_checkpoint_resumes_as_plain_adamw_resumes(tmp_path: Path) -> None:
    # Lightning's own resume is the reference (it need not equal an uninterrupted run): swapping changes nothing.
    plain, plain_optimizer, plain_saved = _stop_and_resume(PlainAdamWRegression, tmp_path / "plain")
    swapped, optimizer, saved = _stop_and_resume(SwappedAdamWRegression, tmp_path / "swapped")
    assert isinstance(optimizer, SwapOptimizer)
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}, "AdamW's own state_dict format"
    assert_state_dicts_equal(plain_saved, saved, "checkpointed optimizer")
    _assert_equal(plain, swapped, "resumed swapped vs resumed plain")
    assert_state_dicts_equal(plain_optimizer.state_dict(), optimizer.state_dict(), "resumed optimizer")
