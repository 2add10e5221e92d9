"""Hugging Face Trainer: hand it a swapped optimizer, or let a Trainer subclass wrap the one it builds.

``Trainer(optimizers=(optimizer, scheduler))`` takes any ``torch.optim.Optimizer``; a
``SwapOptimizer`` is one. Build it after the model is on its device (the Trainer does not move an
optimizer's parameters), with the schedule the Trainer would have made::

    optimizer, scheduler = swapped_adamw_and_schedule(model, args)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, optimizers=(optimizer, scheduler))

The Trainer refuses ``optimizers`` when it shards the model itself (``fsdp=...`` in the
arguments) and builds its optimizer after sharding; ``SwapTrainer`` wraps that optimizer, which
also keeps the Trainer's own weight-decay groups and ``optim`` choice. Checkpoints
(``optimizer.pt``) are the wrapped optimizer's own format, so a run saved with swapping resumes
without it and the other way round.
"""

from __future__ import annotations

import torch
from transformers import Trainer, TrainingArguments, get_scheduler

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer


def swapped_adamw_and_schedule(
    model: torch.nn.Module, args: TrainingArguments, swap: SwapConfig | None = None
) -> tuple[SwapOptimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over ``model``'s trainable parameters with its states swapped, and ``args``' LR schedule."""
    params = [param for param in model.parameters() if param.requires_grad]
    optimizer = swap_optimizer(
        torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay), swap or SwapConfig()
    )
    scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=args.get_warmup_steps(args.max_steps),
        num_training_steps=args.max_steps,
    )
    return optimizer, scheduler


class SwapTrainer(Trainer):
    """A Trainer whose own optimizer (``args.optim``, its weight-decay groups) has its states swapped."""

    swap_config: SwapConfig = SwapConfig()

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        if not isinstance(optimizer, SwapOptimizer):
            self.optimizer = swap_optimizer(optimizer, self.swap_config)
        return self.optimizer
