"""swap-bench: the swapped optimizer against the unswapped one and against the link, in one run.

Run ``swap-bench --help`` (or ``python -m swap_bench``). Timings are reported, never asserted.
``swap-bench plan`` says whether a training job fits and how much slower it is (:mod:`swap_bench.fit`);
``swap-bench plan --tables`` models one rank of a real model size over meta tensors on the simulator's virtual
clock (:mod:`swap_bench.planner`).
"""

from .cli import main, plan_rows, run_bench
from .modeled import ModeledRow, StepModel, model_step
from .models import MODELS, ModelShape, fsdp_shard_shape
from .planner import plan_main, plan_model

__all__ = [
    "MODELS",
    "ModelShape",
    "ModeledRow",
    "StepModel",
    "fsdp_shard_shape",
    "main",
    "model_step",
    "plan_main",
    "plan_model",
    "plan_rows",
    "run_bench",
]
