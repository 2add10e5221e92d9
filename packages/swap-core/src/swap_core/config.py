"""User-facing configuration of a swapped optimizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Literal, get_args

from .backends.accelerator import SUPPORTED_DEVICE_TYPES
from .backends.host_memory import HOST_MEMORY_MODES, HostMemoryMode
from .backends.protocol import DeviceBackend

__all__ = ["BACKEND_NAMES", "PREFETCH_MODES", "STEP_MODES", "BackendSpec", "PrefetchMode", "StepMode", "SwapConfig"]

BACKEND_NAMES = ("auto", "sim", *SUPPORTED_DEVICE_TYPES)

PrefetchMode = Literal["off", "backward"]
"""When batch 0's copy-in starts before ``step()``: on an explicit ``opt.prefetch()`` only, or from the backward."""

PREFETCH_MODES: tuple[PrefetchMode, ...] = get_args(PrefetchMode)
"""The valid values of ``SwapConfig.prefetch``."""

StepMode = Literal["after_backward", "in_backward"]
"""When the batches update: all in ``step()`` after the backward, or each inside the backward once its gradients
are final."""

STEP_MODES: tuple[StepMode, ...] = get_args(StepMode)
"""The valid values of ``SwapConfig.step``."""

BackendSpec = str | DeviceBackend


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SwapConfig.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"Invalid SwapConfig.{name}: {value} (must be >= {minimum})")


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"SwapConfig.{name} must be a bool, got {value!r} ({type(value).__name__})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwapConfig:
    """How optimizer states are swapped between pinned host memory and the device."""

    swap_times: int | Literal["auto"] = 16
    """Number of consecutive batches the parameters are split into (more batches: less device memory). ``"auto"``:
    the fewest batches whose staging fits ``device_memory_fraction`` of the device memory available when the swap
    is planned (re-planned when the states change); an out-of-memory while staging, before any batch updates,
    re-plans with twice the batches and retries once."""

    device_memory_fraction: float = 0.8
    """With ``swap_times="auto"``: the share of the available device memory (free, and cached unused by torch's
    allocator) that the staging may take; the rest is the margin for everything else the step allocates."""

    max_batch_bytes: int | None = None
    """Upper bound on swapped state bytes per batch; adds batches beyond ``swap_times`` when needed.

    When the adapter supplies rank-independent partition costs (distributed families), the bound
    applies to those costs, which such adapters express in bytes."""

    packed: bool = True
    """Move each batch as one copy per dtype through the staging arenas (else one copy per tensor)."""

    staging_buffers: int = 2
    """Batches staged on the device at a time during a step (at least 2): one arena each when packed, so the state
    peak is about ``staging_buffers * S / swap_times`` for ``S`` swapped bytes. Each buffer beyond two lets the
    copy-ins run one more batch ahead of the copy-outs, which follow the updates: worth its memory where the link is
    slower than the compute (docs/configuration.md)."""

    min_numel: int = 1024
    """States with fewer elements stay resident on the device."""

    state_keys: tuple[str, ...] | None = None
    """State keys to swap; ``None`` swaps every key the adapter declares swappable."""

    offload_fraction: float = 1.0
    """Share of swappable state bytes kept in host memory; the rest stays resident on the device."""

    duplex: bool = True
    """Run host-to-device and device-to-host copies on separate streams (full-duplex links)."""

    keep_staging: bool = False
    """Keep the device staging arenas allocated between steps (faster, holds device memory)."""

    trace: bool = False
    """Record each step's per-batch copy and update intervals in ``opt.trace`` (the step then waits for the device)."""

    backend: BackendSpec = "auto"
    """``"auto"`` (the parameters' device), ``"sim"``, ``"cuda"``, ``"npu"``, ``"xpu"`` or a backend."""

    master_weights: bool = False
    """Keep an fp32 master copy of every bfloat16/float16 parameter as optimizer state (``"master_param"``),
    swapped with the other states; the update runs on the masters with fp32 gradients and fp32 states, and
    each parameter is then set from its master. fp32 parameters are unaffected (see docs/master-weights.md)."""

    master_remainders: bool = True
    """With ``master_weights``: keep a bf16 parameter's master as the bits the parameter lacks
    (``"master_remainder"``, 2.125 bytes a parameter instead of 4) where every update runs in ``step()`` (the step
    after the backward); ``False``: fp32 masters everywhere (an edit of a parameter between steps is then
    overwritten by its master, as in the reference loop). Results are bitwise the same either way."""

    prefetch: PrefetchMode = "off"
    """``"backward"``: the first batch's copy-in starts during the backward, as soon as every gradient of that batch
    is final (``opt.prefetch()`` from post-accumulate-grad hooks), and batches are walked in the order a backward
    finalizes gradients (the last parameters first); ``"off"``: only an explicit ``opt.prefetch()`` starts it."""

    step: StepMode = "after_backward"
    """``"in_backward"``: each batch updates inside the backward, from post-accumulate-grad hooks, as soon as every
    gradient of its parameters is final, so its copies run under the rest of the backward; ``step()`` then updates
    what remains and commits the step, or takes it back and steps again after the backward when what the updates
    read changed since (docs/step-in-backward.md). The batches are walked in the order a backward finalizes
    gradients. ``"after_backward"``: every batch updates in ``step()``."""

    provisional_updates: bool = True
    """With ``step="in_backward"``: the updates made inside the backward are provisional until ``step()`` commits
    them. Each batch copies its states out to a second host copy (the first stays as it was: a commit makes the
    second current, copying nothing) and keeps its parameters and resident states as they were. ``step()`` commits
    when nothing the updates read changed since; otherwise (``clip_grad_norm_``, ``GradScaler``, a new learning rate,
    an edit of the state) it takes them back and steps again after the backward, bitwise the plain optimizer; a
    backward that fails or is abandoned, and an optimizer closed or collected, take them back too. The cost: twice
    the host memory of the swapped states, and one device-to-host copy of each updated parameter per step. ``False``
    (host memory short): one host copy, and such edits are refused at ``step()`` after the fact."""

    free_gradients: bool = False
    """With ``step="in_backward"``: drop each batch's gradients (``p.grad = None``) as soon as its update is issued
    inside the backward, as torchtune's ``optimizer_in_bwd`` does, so that the gradients of the layers already
    updated are freed while the backward goes on (they read ``None`` after it; ``clip_grad_norm_`` then sees only
    the gradients left). Where the hooks run under another stream than the steps (FSDP2's post-reduce stream), each
    gradient's block is kept from reuse until its update is done (docs/step-in-backward.md)."""

    host_memory: HostMemoryMode = "exact"
    """``"exact"``: host buffers pinned at their size, to the page (CUDA registers them with the driver; elsewhere
    the caching path, with a warning); ``"caching"``: torch's pinned allocator, which rounds up to a power of two."""

    undo_failed_steps: bool = False
    """Keep, during every step, each batch's parameters and states as they were before its update (in pageable host
    memory: the host waits for each batch's copy), so that a step that fails part-way is undone whole. Off, only a
    step that creates every state it updates (a first step) is undone whole; any other failed step leaves each
    parameter whole, its update and states or neither (docs/behaviour.md, "A step that fails"). With
    ``step="in_backward"`` (provisional updates only) the journal is kept for a step that runs after the backward (one
    taken back and run again included): a step begun inside the backward that fails is taken back whole anyway."""

    def __post_init__(self) -> None:
        if self.swap_times != "auto":
            _require_int("swap_times", self.swap_times, minimum=1)
        _validate_fraction("device_memory_fraction", self.device_memory_fraction, low_open=True)
        if self.max_batch_bytes is not None:
            _require_int("max_batch_bytes", self.max_batch_bytes, minimum=1)
        _require_bool("packed", self.packed)
        _require_int("staging_buffers", self.staging_buffers, minimum=2)
        _require_int("min_numel", self.min_numel, minimum=0)
        object.__setattr__(self, "state_keys", _normalize_state_keys(self.state_keys))
        _validate_fraction("offload_fraction", self.offload_fraction)
        _require_bool("duplex", self.duplex)
        _require_bool("keep_staging", self.keep_staging)
        _require_bool("trace", self.trace)
        _require_bool("master_weights", self.master_weights)
        _require_bool("master_remainders", self.master_remainders)
        _require_bool("undo_failed_steps", self.undo_failed_steps)
        _require_bool("free_gradients", self.free_gradients)
        _require_bool("provisional_updates", self.provisional_updates)
        if self.free_gradients and self.step != "in_backward":
            raise ValueError(
                "SwapConfig(free_gradients=True) frees each batch's gradients after its update inside the backward: "
                f"it needs step='in_backward', got step={self.step!r}"
            )
        _validate_backend(self.backend)
        if self.prefetch not in PREFETCH_MODES:
            raise ValueError(f"Invalid SwapConfig.prefetch: {self.prefetch!r}; expected one of {PREFETCH_MODES}")
        if self.step not in STEP_MODES:
            raise ValueError(f"Invalid SwapConfig.step: {self.step!r}; expected one of {STEP_MODES}")
        if self.step == "in_backward":
            self._check_in_backward()
        if self.host_memory not in HOST_MEMORY_MODES:
            raise ValueError(
                f"Invalid SwapConfig.host_memory: {self.host_memory!r}; expected one of {HOST_MEMORY_MODES}"
            )

    def _check_in_backward(self) -> None:
        """Refuse what ``step="in_backward"`` does not support yet, naming the setting to change."""
        unsupported = {
            "prefetch": (self.prefetch != "off", "it copies each batch in from the backward itself"),
            "undo_failed_steps": (
                self.undo_failed_steps and not self.provisional_updates,
                "with provisional_updates=False a batch updated inside the backward wrote its host mirrors, so a "
                "failed step cannot be undone; keep provisional_updates=True (a step begun inside the backward that "
                "fails is then taken back whole)",
            ),
        }
        for name, (refused, why) in unsupported.items():
            if refused:
                raise ValueError(
                    f"SwapConfig(step='in_backward') does not support {name}={getattr(self, name)!r} yet: {why}"
                )

    def replace(self, **overrides: object) -> SwapConfig:
        """A copy with ``overrides`` applied and validated; unknown names raise ``TypeError``."""
        known = {field.name for field in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"Unknown SwapConfig field(s) {unknown}; valid fields are {sorted(known)}")
        return dataclasses.replace(self, **overrides)  # type: ignore[arg-type]


def _normalize_state_keys(state_keys: object) -> tuple[str, ...] | None:
    if state_keys is None:
        return None
    if isinstance(state_keys, str) or not isinstance(state_keys, Iterable):
        raise TypeError(f"SwapConfig.state_keys must be a sequence of state key names or None, got {state_keys!r}")
    keys = tuple(state_keys)
    for key in keys:
        if not isinstance(key, str):
            raise TypeError(f"SwapConfig.state_keys entries must be str, got {key!r}")
    if len(set(keys)) != len(keys):
        raise ValueError(f"Invalid SwapConfig.state_keys: {keys} has duplicates")
    return keys


def _validate_fraction(name: str, value: object, *, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"SwapConfig.{name} must be a float, got {value!r}")
    if not (0.0 < value <= 1.0 if low_open else 0.0 <= value <= 1.0):
        interval = "(0, 1]" if low_open else "[0, 1]"
        raise ValueError(f"Invalid SwapConfig.{name}: {value} (must be within {interval})")


def _validate_backend(value: object) -> None:
    if isinstance(value, str):
        if value not in BACKEND_NAMES:
            raise ValueError(
                f"Invalid SwapConfig.backend: {value!r}; expected one of {BACKEND_NAMES} or a DeviceBackend"
            )
        return
    if not isinstance(value, DeviceBackend):
        raise TypeError(f"SwapConfig.backend must be one of {BACKEND_NAMES} or a DeviceBackend instance, got {value!r}")
