"""Hugging Face Trainer with a swapped AdamW trains, checkpoints and resumes bitwise like plain AdamW.

The recipe is examples/integrations/hf_trainer.py. Runs in ``nox -s integrations`` (transformers
and accelerate installed); skipped elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from swap_core import SwapConfig, SwapOptimizer
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hf_trainer import SwapTrainer, swapped_adamw_and_schedule  # noqa: E402

STEPS, SAVE_AT, VOCAB, LENGTH = 6, 3, 64, 16


def _model() -> Any:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (32, LENGTH), generator=generator)
    return [{"input_ids": row, "labels": row} for row in tokens]


def _args(directory: Path, **overrides: Any) -> Any:
    options: dict[str, Any] = {
        "output_dir": str(directory),
        "max_steps": STEPS,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-3,
        "weight_decay": 0.01,
        "warmup_steps": 2,
        "save_strategy": "steps",
        "save_steps": SAVE_AT,
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
        **overrides,
    }
    return transformers.TrainingArguments(**options)


def _swap(seed: int) -> SwapConfig:
    return SwapConfig(backend=SimBackend(mode="random", seed=seed), swap_times=3, min_numel=64)


def _assert_models_equal(expected: torch.nn.Module, actual: torch.nn.Module, where: str) -> None:
    actual_params = dict(actual.named_parameters())
    for name, param in expected.named_parameters():
        assert_bitwise_equal(param, actual_params[name], f"{where}: {name}")


def test_optimizers_argument_trains_and_resumes_bitwise(tmp_path: Path) -> None:
    plain_model, swapped_model = _model(), _model()
    args = _args(tmp_path / "plain")
    plain_optimizer = torch.optim.AdamW(plain_model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    plain_schedule = transformers.get_scheduler(
        args.lr_scheduler_type, plain_optimizer, num_warmup_steps=2, num_training_steps=STEPS
    )
    plain = transformers.Trainer(
        model=plain_model, args=args, train_dataset=_dataset(), optimizers=(plain_optimizer, plain_schedule)
    )
    plain.train()

    swapped_args = _args(tmp_path / "swapped")
    optimizer, schedule = swapped_adamw_and_schedule(swapped_model, swapped_args, _swap(seed=3))
    swapped = transformers.Trainer(
        model=swapped_model, args=swapped_args, train_dataset=_dataset(), optimizers=(optimizer, schedule)
    )
    swapped.train()
    assert optimizer.stats.h2d_bytes > 0, "the states did not stream: the Trainer bypassed the SwapOptimizer"
    _assert_models_equal(plain_model, swapped_model, "swapped vs plain")
    assert_state_dicts_equal(plain_optimizer.state_dict(), optimizer.state_dict(), "optimizer")

    # optimizer.pt of the swapped run is AdamW's own format: resume it swapped, in a new Trainer.
    checkpoint = tmp_path / "swapped" / f"checkpoint-{SAVE_AT}"
    plain_saved = torch.load(tmp_path / "plain" / f"checkpoint-{SAVE_AT}" / "optimizer.pt", weights_only=True)
    assert_state_dicts_equal(plain_saved, torch.load(checkpoint / "optimizer.pt", weights_only=True), "optimizer.pt")
    resumed_model = _model()
    resumed_args = _args(tmp_path / "resumed")
    resumed_optimizer, resumed_schedule = swapped_adamw_and_schedule(resumed_model, resumed_args, _swap(seed=4))
    resumed = transformers.Trainer(
        model=resumed_model,
        args=resumed_args,
        train_dataset=_dataset(),
        optimizers=(resumed_optimizer, resumed_schedule),
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == STEPS
    _assert_models_equal(plain_model, resumed_model, "resumed vs uninterrupted")
    assert_state_dicts_equal(plain_optimizer.state_dict(), resumed_optimizer.state_dict(), "resumed optimizer")


def test_trainer_subclass_wraps_the_optimizer_it_builds(tmp_path: Path) -> None:
    plain_model, swapped_model = _model(), _model()
    plain = transformers.Trainer(model=plain_model, args=_args(tmp_path / "plain"), train_dataset=_dataset())
    plain.train()

    class SimSwapTrainer(SwapTrainer):
        swap_config = _swap(seed=5)

    swapped = SimSwapTrainer(model=swapped_model, args=_args(tmp_path / "swapped"), train_dataset=_dataset())
    swapped.train()
    inner = swapped.optimizer.optimizer  # accelerate's AcceleratedOptimizer around the SwapOptimizer
    assert isinstance(inner, SwapOptimizer), type(inner)
    assert type(inner.optimizer) is type(plain.optimizer.optimizer), "the Trainer's own optimizer choice is kept"
    assert [len(group["params"]) for group in inner.param_groups] == [
        len(group["params"]) for group in plain.optimizer.optimizer.param_groups
    ], "the Trainer's weight-decay groups are kept"
    assert inner.stats.h2d_bytes > 0
    _assert_models_equal(plain_model, swapped_model, "SwapTrainer vs Trainer")
    assert_state_dicts_equal(plain.optimizer.state_dict(), swapped.optimizer.state_dict(), "optimizer")
