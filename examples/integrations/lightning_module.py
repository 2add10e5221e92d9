"""PyTorch Lightning: return the swapped optimizer from ``configure_optimizers``.

Lightning calls ``configure_optimizers`` after it has moved the module to its device, so the
parameters the optimizer sees are already where they train; wrap the optimizer there and give the
scheduler the wrapper. Automatic optimization calls ``optimizer.step(closure)``: a
``SwapOptimizer`` runs the closure once (forward and backward), then streams the states through the
device. ``trainer.save_checkpoint`` stores ``optimizer.state_dict()``: the wrapped optimizer's own
format.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from swap_core import SwapConfig, swap_optimizer


class SwappedAdamWRegression(pl.LightningModule):
    """A small regression model trained with AdamW whose states are swapped."""

    def __init__(self, swap: SwapConfig | None = None, lr: float = 1e-2) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
        self.swap = swap or SwapConfig()
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_index: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self) -> Any:
        optimizer = swap_optimizer(torch.optim.AdamW(self.parameters(), lr=self.lr), self.swap)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
