"""How ``swap-bench device-perf`` sizes its model and its tokens for the device it runs on.

Every row's process holds two copies of the model: the plain one, with AdamW over fp32 masters on the device
(:data:`PLAIN_BYTES_PER_PARAM`), and the one it is compared with (:data:`ROW_MODEL_BYTES_PER_PARAM`, plus two staging
arenas when it is swapped). :func:`fitted_shape` keeps the model's layers while that takes at most
:data:`MODEL_SHARE` of the device's free memory, fewer otherwise; the rest is for activations.

The tokens of an iteration decide how long its backward runs, and so whether a step inside the backward can hide
its copies: every swapped byte goes in and out once (:func:`transfer_seconds`, at the raw pinned-copy rates measured
in the same run). :func:`plan_tokens` gives the long rows a backward :data:`HIDE_FACTOR` times that long, and the
short row one :data:`SHORT_FACTOR` times it (too short to hide them), from a forward and backward timed at a probe
token count; the long rows get fewer when their activations would not fit.
"""

from __future__ import annotations

import dataclasses
import math

from .link import LinkBandwidth
from .models import ModelShape

__all__ = [
    "HIDE_FACTOR",
    "MODEL_SHARE",
    "PLAIN_BYTES_PER_PARAM",
    "ROW_MODEL_BYTES_PER_PARAM",
    "SHORT_FACTOR",
    "SWAPPED_BYTES_PER_PARAM",
    "fitted_shape",
    "plan_tokens",
    "row_device_bytes",
    "transfer_seconds",
]

SWAPPED_BYTES_PER_PARAM = 12
"""What a swapped AdamW step over fp32 masters of bf16 parameters copies each way: the master and the two moments."""
PLAIN_BYTES_PER_PARAM = 20
"""The plain model on the device: its bf16 parameter and gradient, the fp32 master and its gradient, two moments."""
ROW_MODEL_BYTES_PER_PARAM = 4
"""The compared model: its bf16 parameter and gradient (a swapped one's states are in host memory between steps)."""
MODEL_SHARE = 0.5
"""Of the free device memory, the most that the two models and the plain optimizer may take."""
ACTIVATION_SHARE = 0.8
"""Of the free memory the models leave, the most that an iteration's activations may take."""
HIDE_FACTOR = 1.5
"""The long rows' backward, in times the transfers: long enough to hide them."""
SHORT_FACTOR = 0.25
"""The short row's backward, in times the transfers: too short to hide them."""


def row_device_bytes(params: int, swap_times: int) -> int:
    """Device bytes one row's process holds besides activations: both models, the plain optimizer, and two staging
    arenas of a batch of the swapped states."""
    staging = 2 * math.ceil(SWAPPED_BYTES_PER_PARAM * params / swap_times)
    return params * (PLAIN_BYTES_PER_PARAM + ROW_MODEL_BYTES_PER_PARAM) + staging


def fitted_shape(shape: ModelShape, free_bytes: int, swap_times: int) -> ModelShape:
    """``shape``, with fewer layers if needed so that :func:`row_device_bytes` is at most :data:`MODEL_SHARE` of
    ``free_bytes``; ``ValueError`` when one layer does not fit."""
    budget = MODEL_SHARE * free_bytes
    for layers in range(shape.num_hidden_layers, 0, -1):
        fitted = dataclasses.replace(shape, num_hidden_layers=layers)
        if row_device_bytes(fitted.numel, swap_times) <= budget:
            return fitted
    one_layer = dataclasses.replace(shape, num_hidden_layers=1)
    raise ValueError(
        f"{shape.name} does not fit in {free_bytes / 1e9:.2f} GB of free device memory even with one layer "
        f"({row_device_bytes(one_layer.numel, swap_times) / 1e9:.2f} GB for the models and the plain optimizer, "
        f"at most {MODEL_SHARE:.0%} of it); give a smaller --model"
    )


def transfer_seconds(params: int, link: LinkBandwidth) -> float:
    """The least time a step's copies take: every swapped byte in and out once, each direction at its raw rate and
    both at the rate of both directions at once."""
    swapped = SWAPPED_BYTES_PER_PARAM * params
    return max(swapped / link.h2d, swapped / link.d2h, 2 * swapped / link.duplex)


def plan_tokens(
    *,
    transfer_s: float,
    backward_s_per_token: float,
    activation_bytes_per_token: float,
    spare_bytes: int,
    seq_len: int,
    max_tokens: int,
) -> tuple[int, int]:
    """The tokens per iteration of the long rows and of the short one, whole sequences of ``seq_len``.

    Long: a backward of :data:`HIDE_FACTOR` x ``transfer_s``, or as many tokens as the activations fit in
    (:data:`ACTIVATION_SHARE` of ``spare_bytes``; no bound when ``activation_bytes_per_token`` is 0: the simulator does
    not count them) and ``max_tokens`` allow. Short: a backward of :data:`SHORT_FACTOR` x ``transfer_s``, and at most
    a quarter of the long rows' tokens. Each is one sequence at least.
    """
    cap = max_tokens
    if activation_bytes_per_token > 0:
        cap = min(cap, int(ACTIVATION_SHARE * max(spare_bytes, 0) / activation_bytes_per_token))
    cap = max(seq_len, cap // seq_len * seq_len)

    def tokens_for(seconds: float) -> int:
        if backward_s_per_token <= 0:
            return cap
        sequences = math.ceil(seconds / backward_s_per_token / seq_len)
        return min(max(sequences, 1) * seq_len, cap)

    long_tokens = tokens_for(HIDE_FACTOR * transfer_s)
    short_tokens = min(tokens_for(SHORT_FACTOR * transfer_s), max(seq_len, long_tokens // 4 // seq_len * seq_len))
    return long_tokens, short_tokens
