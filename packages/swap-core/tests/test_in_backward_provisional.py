"""``SwapConfig(step="in_backward")`` with provisional updates (the default): what the updates inside the backward
read may change before ``step()`` and the loop stays the plain one, bitwise; a backward that fails or is abandoned,
and an optimizer collected with a step open, change nothing.

Each test runs the same loop over a plain optimizer (the reference) and a swapped one on the simulator.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Callable
from unittest import mock

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.errors import SimInjectedFault, SwapStateError
from swap_core.sim import SIM_MODES, SimBackend, SimMode
from swap_core.testing import planted
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal, assert_trained_alike
from swap_core.testing.pairs import through_torch_save

STEPS = 5


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)
    )


def _inputs(step: int, micro_batch: int = 0) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + micro_batch))


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    return model(_inputs(step)).square().mean()


def _rmsprop(params: object) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(params, lr=1e-2, momentum=0.9, weight_decay=0.01)  # type: ignore[arg-type]


def _swapped(model: torch.nn.Module, sim: SimBackend, **options: object) -> SwapOptimizer:
    config = SwapConfig(backend=sim, swap_times=3, min_numel=32, step="in_backward", **options)  # type: ignore[arg-type]
    return swap_optimizer(_rmsprop(model.parameters()), config)


def _schedules() -> list[tuple[SimMode, int]]:
    return [(mode, seed) for mode in SIM_MODES for seed in ((0, 1) if mode == "random" else (0,))]


# -- edits between backward() and step() ------------------------------------------------------
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize(("mode", "seed"), _schedules())
def test_clipping_between_backward_and_step_is_bitwise_the_plain_loop(mode: SimMode, seed: int, packed: bool) -> None:
    """``clip_grad_norm_`` after the backward, binding on odd steps only: there the step takes back what the backward
    updated with the unclipped gradients and steps with the clipped ones; where it does not bind it multiplied every
    gradient by exactly 1 (their versions moved, their bits did not) and the step commits; bitwise the plain loop."""
    plain_model, model = _model(), _model()
    plain = _rmsprop(plain_model.parameters())
    optimizer = _swapped(model, SimBackend(mode=mode, seed=seed), packed=packed)
    for step in range(STEPS):
        max_norm = 0.05 if step % 2 else 100.0  # binds on odd steps only
        for this_model, this_opt in ((plain_model, plain), (model, optimizer)):
            _loss(this_model, step).backward()
            torch.nn.utils.clip_grad_norm_(this_model.parameters(), max_norm=max_norm)
            this_opt.step()
            this_opt.zero_grad(set_to_none=True)
        assert_trained_alike(plain_model, model, plain, optimizer, f"{mode} {seed} step {step}")
        stats = optimizer.stats
        if step % 2:
            assert stats.batches_taken_back == 3 and stats.batches_in_backward == 0, stats
        elif step > 0:  # the first step makes the states, after the backward
            assert stats.batches_taken_back == 0 and stats.batches_in_backward == 3, stats


@pytest.mark.parametrize("edit", ["data", "detached"])
def test_gradients_edited_where_torch_counts_no_version_are_taken_back(edit: str) -> None:
    """A gradient scaled through ``.data`` (torch's version counter does not move; old clipping code and extension
    kernels edit so) or through ``.detach()``: the step sees the bits changed, takes back and steps again."""
    plain_model, model = _model(), _model()
    plain = _rmsprop(plain_model.parameters())
    optimizer = _swapped(model, SimBackend(mode="random", seed=3))
    for step in range(3):
        for this_model, this_opt in ((plain_model, plain), (model, optimizer)):
            _loss(this_model, step).backward()
            last = list(this_model.parameters())[-1]
            assert last.grad is not None
            (last.grad.data if edit == "data" else last.grad.detach()).mul_(0.5)
            this_opt.step()
            this_opt.zero_grad(set_to_none=True)
        assert_trained_alike(plain_model, model, plain, optimizer, f"{edit}, step {step}")
        assert optimizer.stats.batches_taken_back == (3 if step > 0 else 0), optimizer.stats


@pytest.mark.parametrize("how", ["scheduler", "pre_hook", "tensor_in_place"])
def test_a_learning_rate_changed_before_step_applies_to_the_whole_step_as_in_torch(how: str) -> None:
    """An LR scheduler stepped before the optimizer, a step pre-hook that sets ``lr``, a tensor ``lr`` written in
    place: torch's step uses the new value for every parameter, and so does the swapped one (the batches updated
    inside the backward with the old value are taken back)."""
    tensor_lr = how == "tensor_in_place"

    def make(params: object) -> torch.optim.Optimizer:
        lr: float | torch.Tensor = torch.tensor(0.01) if tensor_lr else 0.01
        return torch.optim.RMSprop(params, lr=lr, momentum=0.9)  # type: ignore[arg-type]

    plain_model, model = _model(), _model()
    plain = make(plain_model.parameters())
    config = SwapConfig(backend=SimBackend(mode="random", seed=7), swap_times=3, min_numel=32, step="in_backward")
    optimizer = swap_optimizer(make(model.parameters()), config)
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in (plain, optimizer)]
    for step in range(4):
        for this_model, this_opt, scheduler in ((plain_model, plain, schedulers[0]), (model, optimizer, schedulers[1])):
            _loss(this_model, step).backward()
            if step == 2:
                if how == "scheduler":
                    scheduler.step()  # before optimizer.step(): its lr is for this step
                elif how == "pre_hook":
                    handle = this_opt.register_step_pre_hook(_halving_lr)
                else:
                    this_opt.param_groups[0]["lr"].fill_(0.004)
            this_opt.step()
            if step == 2 and how == "pre_hook":
                handle.remove()
            this_opt.zero_grad(set_to_none=True)
        assert_trained_alike(plain_model, model, plain, optimizer, f"{how} step {step}")
    assert optimizer.stats.batches_taken_back == 0, "the steps after the change commit"


def _halving_lr(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] / 2


def test_state_read_between_backward_and_step_is_the_state_before_the_step() -> None:
    """Between ``backward()`` and ``step()`` torch's state is the last step's: so is the swapped one's (the updates
    inside the backward went to the second host copy), and an edit of it in place there is exact."""
    plain_model, model = _model(), _model()
    plain = _rmsprop(plain_model.parameters())
    optimizer = _swapped(model, SimBackend(mode="lazy"))
    for step in range(4):
        pairs = ((plain_model, plain), (model, optimizer))
        for this_model, _ in pairs:
            _loss(this_model, step).backward()
        if step == 2:  # the backward updated every batch provisionally
            assert_state_dicts_equal(plain.state_dict(), optimizer.state_dict(), "between backward and step")
            for this_model, this_opt in pairs:
                first = next(iter(this_model.parameters()))
                this_opt.state[first]["square_avg"].mul_(0.5)  # an edit in place, before the step
        for _, this_opt in pairs:
            this_opt.step()
            this_opt.zero_grad(set_to_none=True)
        assert_trained_alike(plain_model, model, plain, optimizer, f"step {step}")
        assert optimizer.stats.batches_in_backward == (3 if step in (1, 3) else 0), (step, optimizer.stats)


# -- GradScaler ---------------------------------------------------------------------------
@pytest.mark.parametrize("unscale_to_clip", [False, True], ids=["scaler_step", "unscale_clip_step"])
def test_grad_scaler_with_an_inf_step_is_bitwise_the_plain_loop(unscale_to_clip: bool) -> None:
    """The fp16 loop: the forward under fp16 autocast, scaled backward, (``unscale_`` and clipping,) ``scaler.step``,
    ``scaler.update``; one step whose gradients hold an inf is skipped, as torch's ``GradScaler`` skips it, and the
    scale follows."""
    plain_model, model = _model(), _model()
    plain = _rmsprop(plain_model.parameters())
    optimizer = _swapped(model, SimBackend(mode="random", seed=3))
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) for _ in range(2)]
    for step in range(6):
        for this_model, this_opt, scaler in ((plain_model, plain, scalers[0]), (model, optimizer, scalers[1])):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _loss(this_model, step).float() * (float("inf") if step == 3 else 1.0)
            scaler.scale(loss).backward()
            if unscale_to_clip:
                scaler.unscale_(this_opt)
                torch.nn.utils.clip_grad_norm_(this_model.parameters(), max_norm=0.1)
            scaler.step(this_opt)
            scaler.update()
            this_opt.zero_grad(set_to_none=True)
        assert scalers[0].get_scale() == scalers[1].get_scale(), step
        assert_trained_alike(plain_model, model, plain, optimizer, f"step {step}")


# -- backwards that fail or are abandoned ---------------------------------------------------------
def _raising_at(model: torch.nn.Sequential, steps: set[int]) -> Callable[[int], torch.Tensor]:
    """The loss with a hook on the first layer's output that raises on ``steps``: by then the backward updated the
    batches of the later layers."""

    def loss(step: int) -> torch.Tensor:
        hidden = model[0](_inputs(step))
        if step in steps:
            hidden.register_hook(_raise)
        for layer in list(model)[1:]:
            hidden = layer(hidden)
        return hidden.square().mean()

    return loss


def _raise(grad: torch.Tensor) -> torch.Tensor:
    raise KeyboardInterrupt("planted in the backward")


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_a_backward_that_raises_midway_is_taken_back_by_zero_grad(packed: bool) -> None:
    """A backward raises after some batches updated inside it; the loop catches it, calls ``zero_grad()`` and goes
    on: the parameters and the state are as if that iteration never ran, and the state can be read meanwhile."""
    plain_model, model = _model(), _model()
    plain = _rmsprop(plain_model.parameters())
    sim = SimBackend(mode="random", seed=4)
    optimizer = _swapped(model, sim, packed=packed)
    loss = _raising_at(model, {2})
    for step in range(STEPS):
        if step != 2:
            _loss(plain_model, step).backward()
            plain.step()
            plain.zero_grad(set_to_none=True)
        try:
            loss(step).backward()
        except KeyboardInterrupt:
            assert step == 2
            assert_state_dicts_equal(plain.state_dict(), optimizer.state_dict(), "after the failed backward")
            optimizer.zero_grad(set_to_none=True)
            assert_trained_alike(plain_model, model, plain, optimizer, "after zero_grad")
            continue
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert_trained_alike(plain_model, model, plain, optimizer, f"step {step}")
    assert not sim.races, sim.races


def _failed_backward_taken_back(part: str | None) -> None:
    """Two steps, a backward raising after some batches updated, ``zero_grad()``: as the twin that skipped it (with
    a part of the take-back missing, ``part``, the check must fail)."""
    twin_model, model = _model(), _model()
    twin = _rmsprop(twin_model.parameters())
    optimizer = _swapped(model, SimBackend(mode="random", seed=6))
    with planted.take_back_misses(part) if part else contextlib.nullcontext():
        _two_steps_then_a_raising_backward(twin_model, twin, model, optimizer)
        optimizer.zero_grad(set_to_none=True)
    assert_trained_alike(twin_model, model, twin, optimizer, f"taken back, missing {part}")


@pytest.mark.parametrize("part", ["swapped_states", "resident_states", "params"])
def test_a_take_back_missing_a_part_fails_the_check(part: str) -> None:
    """Planted: the take-back misses the swapped states, the resident ones (RMSprop's step counters) or the
    parameters; the check that a failed backward leaves everything as before fails."""
    _failed_backward_taken_back(None)
    with pytest.raises(AssertionError):
        _failed_backward_taken_back(part)


def test_a_take_back_whose_copies_back_keep_failing_names_what_it_could_not_put_back() -> None:
    """Every copy back of a take-back fails, tried twice: ``zero_grad()`` raises naming the parameters it could not
    put back and the fix (a checkpoint), after putting back everything else."""
    twin_model, model = _model(), _model()
    twin = _rmsprop(twin_model.parameters())
    sim = SimBackend(mode="lazy")
    optimizer = _swapped(model, sim)
    _two_steps_then_a_raising_backward(twin_model, twin, model, optimizer)
    copy = sim.copy

    def refused(dst: torch.Tensor, src: torch.Tensor, *, stream: object) -> None:
        if stream == sim.compute_stream():  # a take-back's copies back run there, the walks' on copy streams
            raise RuntimeError("a copy back refused")
        copy(dst, src, stream=stream)  # type: ignore[arg-type]

    with mock.patch.object(sim, "copy", refused), pytest.raises(SwapStateError, match=r"could not put back \d+ param"):
        optimizer.zero_grad(set_to_none=True)
    assert_state_dicts_equal(twin.state_dict(), optimizer.state_dict(), "the states were put back")


def test_a_commit_without_the_check_fails_the_clipping_parity() -> None:
    """Planted: ``step()`` commits though the gradients were clipped after their batches updated."""
    plain_model, model = _model(), _model()
    plain = _rmsprop(plain_model.parameters())
    optimizer = _swapped(model, SimBackend(mode="lazy"))
    with planted.commits_without_the_check(), pytest.raises(AssertionError, match="differ"):
        for step in range(3):
            for this_model, this_opt in ((plain_model, plain), (model, optimizer)):
                _loss(this_model, step).backward()
                torch.nn.utils.clip_grad_norm_(this_model.parameters(), max_norm=0.05)
                this_opt.step()
                this_opt.zero_grad(set_to_none=True)
            assert_trained_alike(plain_model, model, plain, optimizer, f"step {step}")


def test_a_backward_after_a_failed_one_without_zero_grad_is_refused_and_takes_it_back() -> None:
    """The loop ran a forward over the provisionally updated parameters: refused at the next backward's first hook,
    naming the fix, with the failed backward's updates taken back."""
    twin_model, model = _model(), _model()
    twin = _rmsprop(twin_model.parameters())
    optimizer = _swapped(model, SimBackend(mode="lazy"))
    _two_steps_then_a_raising_backward(twin_model, twin, model, optimizer)
    with pytest.raises(SwapStateError, match=r"forward before it ran on parameters updated provisionally.* zero_grad"):
        _loss(model, 3).backward()
    for (name, expected), actual in zip(twin_model.named_parameters(), model.parameters(), strict=True):
        assert_bitwise_equal(expected, actual, f"after the refusal: {name}")
    assert_state_dicts_equal(twin.state_dict(), optimizer.state_dict(), "after the refusal")


def _two_steps_then_a_raising_backward(
    twin_model: torch.nn.Module, twin: torch.optim.Optimizer, model: torch.nn.Sequential, optimizer: SwapOptimizer
) -> None:
    """Two steps of both loops, then a backward of ``model`` that raises after some batches updated (the twin,
    which the failed iteration leaves as it was, runs no third)."""
    for step in range(2):
        _step_both(twin_model, twin, model, optimizer, step)
    with pytest.raises(KeyboardInterrupt):
        _raising_at(model, {2})(2).backward()


def test_an_optimizer_collected_after_a_whole_backward_takes_it_back_with_the_held_copy_out_never_issued() -> None:
    """``del opt; gc.collect()`` after a backward that ended (every batch updated, the last copy-out held for a
    ``step()`` that never comes): the parameters go back to the twin's, and nothing in flight is freed."""
    twin_model, model = _model(), _model()
    twin = _rmsprop(twin_model.parameters())
    sim = SimBackend(mode="random", seed=5)
    optimizer = _swapped(model, sim)
    for step in range(2):
        _step_both(twin_model, twin, model, optimizer, step)
    _loss(model, 2).backward()
    del optimizer
    gc.collect()
    for (name, expected), actual in zip(twin_model.named_parameters(), model.parameters(), strict=True):
        assert_bitwise_equal(expected, actual, f"after the collection: {name}")
    assert not sim.races, sim.races


def test_an_optimizer_collected_with_a_step_open_takes_it_back_and_frees_nothing_in_flight() -> None:
    """``del opt; gc.collect()`` after a backward that raised with batches updated and copies in flight: the
    parameters go back, and no host buffer is freed while a copy still reads or writes it (the race checker)."""
    twin_model, model = _model(), _model()
    twin = _rmsprop(twin_model.parameters())
    sim = SimBackend(mode="lazy")
    optimizer = _swapped(model, sim)
    _two_steps_then_a_raising_backward(twin_model, twin, model, optimizer)
    del optimizer
    gc.collect()
    for (name, expected), actual in zip(twin_model.named_parameters(), model.parameters(), strict=True):
        assert_bitwise_equal(expected, actual, f"after the collection: {name}")
    assert not sim.races, sim.races


def _copies_of_an_iteration(packed: bool) -> int:
    model, sim = _model(), SimBackend()
    optimizer = _swapped(model, sim, packed=packed)
    for step in range(3):
        sim.reset_copy_stats()
        _loss(model, step).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return sim.copy_stats.h2d_copies + sim.copy_stats.d2h_copies


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_a_failure_at_any_copy_of_a_step_that_commits_leaves_everything_as_before_its_backward(packed: bool) -> None:
    """Every copy of an iteration whose step commits fails in turn: inside the backward, or in ``step()`` (the last
    batch's copy-out, held until the commit). The call raises, every parameter and state is as before that backward,
    and the loop goes on, bitwise the plain loop that skipped that iteration."""
    copies = _copies_of_an_iteration(packed)
    assert copies >= 6, "each batch is copied in and out"
    for at in range(copies):
        plain_model, model = _model(), _model()
        plain = _rmsprop(plain_model.parameters())
        sim = SimBackend(mode="random", seed=at)
        optimizer = _swapped(model, sim, packed=packed)
        for step in range(4):
            if step == 2:
                sim.fail_copy(at)
                with pytest.raises(SimInjectedFault):
                    _loss(model, step).backward()
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                assert_trained_alike(plain_model, model, plain, optimizer, f"fault at copy {at}")
                continue
            _step_both(plain_model, plain, model, optimizer, step)
            assert_trained_alike(plain_model, model, plain, optimizer, f"fault at copy {at}, step {step}")
        assert not sim.races, (at, sim.races)


def test_a_commit_whose_held_copy_out_fails_can_step_again() -> None:
    """The last batch's copy-out, held until ``step()`` commits, fails: the step is taken back and says so, and
    ``step()`` called again steps after the backward with the same gradients, bitwise the plain loop."""
    plain_model, model = _model(), _model()
    plain = _rmsprop(plain_model.parameters())
    sim = SimBackend(mode="random", seed=2)
    optimizer = _swapped(model, sim)
    for step in range(4):
        for this_model, this_opt in ((plain_model, plain), (model, optimizer)):
            _loss(this_model, step).backward()
            if this_opt is optimizer and step == 2:
                sim.fail_copy(0, direction="d2h")  # the first copy-out after the backward: the held one
                with pytest.raises(SimInjectedFault) as failed:
                    optimizer.step()
                if sys.version_info >= (3, 11):  # exception notes
                    assert "was taken back" in "".join(failed.value.__notes__)
            this_opt.step()
            this_opt.zero_grad(set_to_none=True)
        if step == 2:
            assert optimizer.stats.batches_in_backward == 0, "the step called again ran after the backward"
        assert_trained_alike(plain_model, model, plain, optimizer, f"step {step}")
    assert not sim.races, sim.races


def _backward_clipped(model: torch.nn.Module, step: int, *, binding: bool) -> None:
    dtype = next(model.parameters()).dtype
    model(_inputs(step).to(dtype)).float().square().mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05 if binding else 100.0)


def _failing_redo(
    optimizer: SwapOptimizer, sim: SimBackend, fault: tuple[str, int]
) -> contextlib.AbstractContextManager[object]:
    """Arms ``fault`` for the step: a copy (``("copy", n)``, the n-th after arming) or the update of batch n."""
    kind, at = fault
    if kind == "copy":
        sim.fail_copy(at)
        return contextlib.nullcontext()
    update, calls = optimizer.adapter.update, iter(range(1_000))

    def failing(*args: object, **kwargs: object) -> object:
        if next(calls) == at:
            raise RuntimeError(f"planted: update {at} fails")
        return update(*args, **kwargs)

    return mock.patch.object(optimizer.adapter, "update", failing)


@pytest.mark.parametrize("masters", [False, True], ids=["fp32", "bf16-masters"])
def test_with_undo_failed_steps_a_step_run_again_that_fails_anywhere_leaves_everything_as_before_its_backward(
    masters: bool,
) -> None:
    """``SwapConfig(undo_failed_steps=True)`` inside the backward: a binding clip takes the step back and it runs
    again after the backward; that run fails at each of its copies and updates in turn. The step raises, every
    parameter and state is as before that backward, and the loop goes on, bitwise a twin that skipped the iteration."""
    dtype = torch.bfloat16 if masters else torch.float32
    counted, sim = _model().to(dtype), SimBackend()
    optimizer = _swapped(counted, sim, master_weights=masters)
    for step in range(3):
        _backward_clipped(counted, step, binding=True)
        sim.reset_copy_stats()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    copies = sim.copy_stats.h2d_copies + sim.copy_stats.d2h_copies  # those of a step taken back and run again
    counted, sim = _model().to(dtype), SimBackend()
    # Counted with fp32 masters, as inside the backward (after it, a bf16 master would be kept as its remainder).
    config = SwapConfig(backend=sim, swap_times=3, min_numel=32, master_weights=masters, master_remainders=False)
    after_backward = swap_optimizer(_rmsprop(counted.parameters()), config)
    for step in range(3):
        _backward_clipped(counted, step, binding=True)
        sim.reset_copy_stats()
        after_backward.step()
        after_backward.zero_grad(set_to_none=True)
    run_again = sim.copy_stats.h2d_copies + sim.copy_stats.d2h_copies  # the step run again: every one fails it
    faults = [*(("copy", at) for at in range(copies)), *(("update", at) for at in range(4))]
    raised = 0
    for fault in faults:
        model, twin_model = _model().to(dtype), _model().to(dtype)
        sim = SimBackend(mode="random", seed=fault[1])
        optimizer = _swapped(model, sim, undo_failed_steps=True, master_weights=masters)
        twin = _swapped(twin_model, SimBackend(mode="lazy"), master_weights=masters)
        for step in range(4):
            if step == 2:
                params = [param.detach().clone() for param in model.parameters()]
                saved = through_torch_save(optimizer.state_dict())
                _backward_clipped(model, step, binding=True)
                with _failing_redo(optimizer, sim, fault):
                    try:
                        optimizer.step()
                    except (RuntimeError, SimInjectedFault):
                        raised += 1
                    else:  # a copy the take-back retried: it stepped
                        _backward_clipped(twin_model, step, binding=True)
                        twin.step()
                        twin.zero_grad(set_to_none=True)
                        optimizer.zero_grad(set_to_none=True)
                        continue
                for index, (before, param) in enumerate(zip(params, model.parameters(), strict=True)):
                    assert_bitwise_equal(before, param, f"{fault}: parameter {index} after the failed step")
                assert_state_dicts_equal(saved, optimizer.state_dict(), f"{fault}: state after the failed step")
                optimizer.zero_grad(set_to_none=True)
                continue
            for this_model, this_opt in ((twin_model, twin), (model, optimizer)):
                _backward_clipped(this_model, step, binding=step % 2 == 1)
                this_opt.step()
                this_opt.zero_grad(set_to_none=True)
            assert_trained_alike(twin_model, model, twin, optimizer, f"{fault}, step {step}")
        assert not sim.races, (fault, sim.races)
    assert raised >= run_again + 3, f"the step run again should fail at each of its copies and updates ({raised})"


def test_a_step_whose_commit_check_fails_is_taken_back() -> None:
    """Finding out whether the step begun inside the backward may commit fails (planted): ``step()`` raises with
    everything as before that backward, nothing is left open (the state can be read), and the loop goes on, bitwise
    the plain loop that skipped that iteration."""
    plain_model, model = _model(), _model()
    plain = _rmsprop(plain_model.parameters())
    sim = SimBackend(mode="random", seed=3)
    optimizer = _swapped(model, sim)
    for step in range(4):
        if step == 2:
            _loss(model, step).backward()
            with planted.commit_check_fails(), pytest.raises(RuntimeError, match="planted"):
                optimizer.step()
            assert_trained_alike(plain_model, model, plain, optimizer, "after the failed check")
            optimizer.zero_grad(set_to_none=True)
            continue
        _step_both(plain_model, plain, model, optimizer, step)
        assert_trained_alike(plain_model, model, plain, optimizer, f"step {step}")
    assert not sim.races, sim.races


# -- parameters the backward still reads ---------------------------------------------------------
def test_a_layer_frozen_with_its_zeroed_gradient_kept_steps_as_in_torch() -> None:
    """``zero_grad(set_to_none=False)`` keeps zeroed gradients; a layer frozen mid-training keeps one and takes no
    new one: torch steps it with zeros after the backward (which still reads its weight): the swapped optimizer does
    the same, and the backward does not see it updated."""
    plain_model, model = _model(), _model()
    plain = _rmsprop(plain_model.parameters())
    optimizer = _swapped(model, SimBackend(mode="random", seed=5))
    for step in range(STEPS):
        if step == 2:
            for frozen in (plain_model[2], model[2]):
                frozen.requires_grad_(False)
        for this_model, this_opt in ((plain_model, plain), (model, optimizer)):
            _loss(this_model, step).backward()
            this_opt.step()
            this_opt.zero_grad(set_to_none=False)
        assert_trained_alike(plain_model, model, plain, optimizer, f"step {step}")


@pytest.mark.parametrize("depth", ["fixed", "data_dependent"])
def test_a_block_shared_across_reentrant_checkpoints_steps_as_in_torch(depth: str) -> None:
    """A block applied several times, each under ``checkpoint(use_reentrant=True)``: its gradient accumulates over
    several nested backwards, and is final only when the outer one ends (a recomputation must never see it
    updated). Bitwise the plain loop, at a fixed depth and at one that changes with the data."""

    class Shared(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.head, self.block, self.tail = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 16)

        def forward(self, inputs: torch.Tensor, repeats: int) -> torch.Tensor:
            hidden = self.head(inputs)
            for _ in range(repeats):
                hidden = checkpoint(lambda x: torch.tanh(self.block(x)), hidden, use_reentrant=True)
            return self.tail(hidden)

    plain_model, model = Shared(), Shared()
    plain = _rmsprop(plain_model.parameters())
    optimizer = swap_optimizer(
        _rmsprop(model.parameters()),
        SwapConfig(backend=SimBackend(mode="random", seed=6), swap_times=3, min_numel=32, step="in_backward"),
    )
    for step in range(STEPS):
        repeats = 3 if depth == "fixed" else 1 + step % 3
        for this_model, this_opt in ((plain_model, plain), (model, optimizer)):
            this_model(_inputs(step), repeats).square().mean().backward()
            this_opt.step()
            this_opt.zero_grad(set_to_none=True)
        assert_trained_alike(plain_model, model, plain, optimizer, f"step {step}")


def _square_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))


def _without_layer(model: torch.nn.Sequential, step: int, dropped: int) -> torch.Tensor:
    """The forward with layer ``dropped`` skipped on odd steps (LayerDrop): it takes no gradient there."""
    hidden = _inputs(step)
    for index, layer in enumerate(model):
        if not (step % 2 and index == dropped):
            hidden = torch.tanh(layer(hidden))
    return hidden.square().mean()


def test_freed_gradients_come_back_as_zeros_where_zero_grad_keeps_them() -> None:
    """``free_gradients=True`` with ``zero_grad(set_to_none=False)`` and a layer dropped on some steps (LayerDrop):
    torch steps the dropped layer with its zeroed gradient; the freed gradients come back as zeros at
    ``zero_grad``, so the swapped optimizer steps it too."""
    plain_model, model = _square_model(), _square_model()
    plain = _rmsprop(plain_model.parameters())
    config = SwapConfig(
        backend=SimBackend(mode="random", seed=8), swap_times=4, min_numel=8, step="in_backward", free_gradients=True
    )
    optimizer = swap_optimizer(_rmsprop(model.parameters()), config)
    for step in range(STEPS):
        for this_model, this_opt in ((plain_model, plain), (model, optimizer)):
            _without_layer(this_model, step, dropped=1).backward()
            this_opt.step()
            this_opt.zero_grad(set_to_none=False)
        assert_trained_alike(plain_model, model, plain, optimizer, f"step {step}")


def test_a_newer_optimizer_over_the_parameters_steps_them_in_the_backward_alone() -> None:
    """The first optimizer was deleted but lives on in a reference cycle (a step hook that refers to it): its hooks
    still run, but a newer optimizer over the same parameters alone updates them inside the backward, bitwise the
    plain loop with only the new one (an older one still used steps after the backward, at its own step())."""
    plain_model, model = _model(), _model()
    plain = _rmsprop(plain_model.parameters())
    sim = SimBackend(mode="lazy")
    first = _swapped(model, sim)
    _referring_to_itself(first)
    _step_both(plain_model, plain, model, first, 0)
    del first  # alive in its cycle until a collection: its hooks stay registered
    optimizer = _swapped(model, sim)
    plain = _rmsprop(plain_model.parameters())
    for step in range(1, 4):
        _step_both(plain_model, plain, model, optimizer, step)
        assert_trained_alike(plain_model, model, plain, optimizer, f"step {step}")
        assert optimizer.stats.batches_in_backward == (3 if step > 1 else 0), optimizer.stats


def _step_both(
    plain_model: torch.nn.Module,
    plain: torch.optim.Optimizer,
    model: torch.nn.Module,
    optimizer: SwapOptimizer,
    step: int,
) -> None:
    for this_model, this_opt in ((plain_model, plain), (model, optimizer)):
        _loss(this_model, step).backward()
        this_opt.step()
        this_opt.zero_grad(set_to_none=True)


def _referring_to_itself(optimizer: SwapOptimizer) -> None:
    """A step post-hook whose closure refers to ``optimizer``: a reference cycle only a collection ends."""
    optimizer.register_step_post_hook(lambda this, args, kwargs: optimizer)


def test_a_closed_optimizer_steps_no_more_inside_the_backward() -> None:
    """``close()``: the hooks go (a new optimizer may take the parameters over at once), and a step begun inside
    the backward and not ended is taken back."""
    twin_model, model = _model(), _model()
    twin = _rmsprop(twin_model.parameters())
    optimizer = _swapped(model, SimBackend(mode="random", seed=2))
    for step in range(2):
        for this_model, this_opt in ((twin_model, twin), (model, optimizer)):
            _loss(this_model, step).backward()
            this_opt.step()
            this_opt.zero_grad(set_to_none=True)
    _loss(model, 2).backward()
    optimizer.close()  # the backward updated every batch: taken back
    for (name, expected), actual in zip(twin_model.named_parameters(), model.parameters(), strict=True):
        assert_bitwise_equal(expected, actual, f"after close(): {name}")
    _swapped(model, SimBackend())  # the parameters are free


def test_without_provisional_updates_the_second_host_copy_is_not_kept() -> None:
    """``provisional_updates=False``: half the host memory (``opt.stats.host_spare_bytes`` is 0), as before, and no
    pinned copy of the parameters (``host_param_copy_bytes``: with provisional updates, every parameter's bytes)."""
    stats = {}
    for provisional in (True, False):
        model = _model()
        optimizer = _swapped(model, SimBackend(), provisional_updates=provisional)
        for step in range(2):
            _loss(model, step).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        stats[provisional] = optimizer.stats
    assert stats[True].host_spare_bytes == stats[True].host_state_bytes > 0
    assert stats[False].host_spare_bytes == 0
    assert stats[True].host_pinned_bytes > stats[False].host_pinned_bytes
    param_bytes = sum(param.numel() * param.element_size() for param in model.parameters())
    assert (stats[True].host_param_copy_bytes, stats[False].host_param_copy_bytes) == (param_bytes, 0)


def test_the_second_host_copy_leaves_the_device_bytes_between_steps_unchanged() -> None:
    """Between steps (after ``zero_grad``) the device holds as many bytes with provisional updates as without, a step
    taken back and run again included: what they keep is on the host (the spare copy, the parameters' copies); the
    resident states' clones are dropped at commit or take-back. (Without provisional updates the clipped step is
    refused: it is run unclipped there.)"""
    between: dict[bool, list[int]] = {}
    for provisional in (True, False):
        model = _model()
        sim = SimBackend(mode="lazy")
        optimizer = _swapped(model, sim, provisional_updates=provisional)
        between[provisional] = []
        for step in range(4):
            _loss(model, step).backward()
            if step == 2 and provisional:  # a step taken back and run again
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            optimizer.synchronize()
            between[provisional].append(sim.memory_allocated())
    assert between[True] == between[False], between
    assert between[True][0] > 0, "the resident states are counted (their clones would be too)"
