"""``SwapConfig(step="in_backward")``: batches update inside the backward, bitwise the plain optimizer after it.

The simulator's copy counts tell when the batches moved: after ``backward()`` and before ``step()``, a step that
began inside the backward has copied its batches in already.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.backends.protocol import Stream
from swap_core.errors import SwapStateError
from swap_core.sim import SIM_MODES, SimBackend, SimMode
from swap_core.testing.compare import assert_bitwise_equal, assert_trained_alike
from swap_core.testing.masters import MasterReference
from swap_core.testing.pairs import through_torch_save

STEPS = 5


def _model(*, unused_layer: bool = False) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = [
        torch.nn.Linear(16, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 16),
    ]
    if unused_layer:
        layers.append(torch.nn.Linear(16, 16))  # never in the forward: never a gradient
    return torch.nn.Sequential(*layers)


def _forward(model: torch.nn.Sequential, inputs: torch.Tensor, *, unused_layer: bool = False) -> torch.Tensor:
    layers = list(model)[:-1] if unused_layer else list(model)
    for layer in layers:
        inputs = layer(inputs)
    return inputs.square().mean()


def _inputs(step: int, micro_batch: int = 0) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + micro_batch))


def _rmsprop(model: torch.nn.Module) -> torch.optim.Optimizer:
    return _rmsprop_of(list(model.parameters()))


def _in_backward(model: torch.nn.Module, sim: SimBackend, **options: object) -> SwapOptimizer:
    config = SwapConfig(backend=sim, swap_times=3, min_numel=32, step="in_backward", **options)  # type: ignore[arg-type]
    return swap_optimizer(_rmsprop(model), config)


def _schedules() -> Iterator[tuple[SimMode, int]]:
    for mode in SIM_MODES:
        yield from ((mode, seed) for seed in ((0, 1) if mode == "random" else (0,)))


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize(("mode", "seed"), list(_schedules()))
def test_batches_update_inside_the_backward_bitwise_the_plain_optimizer_after_it(
    mode: SimMode, seed: int, packed: bool
) -> None:
    plain_model, model = _model(), _model()
    plain = _rmsprop(plain_model)
    sim = SimBackend(mode=mode, seed=seed)
    optimizer = _in_backward(model, sim, packed=packed)
    for step in range(STEPS):
        _forward(plain_model, _inputs(step)).backward()
        plain.step()
        plain.zero_grad(set_to_none=True)
        copies_before = sim.copy_stats.h2d_copies
        _forward(model, _inputs(step)).backward()
        moved_in_backward = sim.copy_stats.h2d_copies - copies_before
        # The first step makes the states: it runs after the backward. Every later one copies all its batches in
        # during the backward (the first batch's gradients are final before the last layer's are not needed).
        assert (moved_in_backward > 0) == (step > 0), (step, moved_in_backward)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert_trained_alike(plain_model, model, plain, optimizer, f"{mode} {seed} step {step}")
        assert optimizer.stats.batches == 3


@pytest.mark.parametrize("buffers", [2, 3], ids=["two_buffers", "three_buffers"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize(("mode", "seed"), [("lazy", 0), ("random", 6)])
def test_a_prefetch_after_step_brings_the_first_batch_in_for_the_walk_in_the_next_backward(
    mode: SimMode, seed: int, packed: bool, buffers: int
) -> None:
    """``opt.prefetch()`` after ``step()`` issues the first batches' copy-ins under the next forward (one with two
    staging buffers; with three, all three batches); the walk that the backward begins waits for them instead of
    copying them again, and counts them in that step's copies."""
    plain_model, model, twin_model = _model(), _model(), _model()
    plain = _rmsprop(plain_model)
    sim, twin_sim = SimBackend(mode=mode, seed=seed), SimBackend(mode=mode, seed=seed)
    options = {"packed": packed, "staging_buffers": buffers}
    optimizer, twin = _in_backward(model, sim, **options), _in_backward(twin_model, twin_sim, **options)
    for step in range(STEPS):
        _forward(plain_model, _inputs(step)).backward()
        plain.step()
        plain.zero_grad(set_to_none=True)
        for this_model, this_opt in ((model, optimizer), (twin_model, twin)):
            _forward(this_model, _inputs(step)).backward()
            this_opt.step()
            this_opt.zero_grad(set_to_none=True)
        # Every batch copied in once a step, the prefetched one included (a prefetch dropped would copy it twice).
        assert sim.copy_stats.h2d_copies == twin_sim.copy_stats.h2d_copies, step
        assert optimizer.stats.h2d_copies == twin.stats.h2d_copies, (optimizer.stats, twin.stats)
        if step > 0:
            assert optimizer.stats.batches_in_backward == optimizer.stats.batches == 3
        assert_trained_alike(
            plain_model, model, plain, optimizer, f"{mode} {seed} step {step}"
        )  # before prefetch(): a read
        copies_before = sim.copy_stats.h2d_copies  # of the state would drop it
        optimizer.prefetch()
        assert optimizer.prefetched and sim.copy_stats.h2d_copies > copies_before, step


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_hooks_under_another_stream_update_on_the_steps_stream_after_the_gradients_writes(packed: bool) -> None:
    """FSDP2 runs the post-accumulate-grad hooks under its post-reduce stream, where the reduce-scatter that wrote
    the gradient may still run. Here the backward runs under a side stream and each gradient is rewritten there
    first (lazy: still queued when the hook runs). The batches update on the steps' stream, ordered after it
    (without the wait the race checker reports the update's read), and stage there: the side stream's pool takes
    no staging, so the reserved memory stays flat."""
    sim = SimBackend(mode="lazy")
    twins = _UnderPostReduce(sim, packed=packed)
    reserved = []
    for step in range(STEPS):
        twins.backward(step)
        twins.optimizer.step()
        twins.optimizer.zero_grad(set_to_none=True)
        assert twins.optimizer.stats.batches_in_backward == (3 if step > 0 else 0), step
        with sim.compute_scope():  # the next forward reads the parameters on the steps' stream
            for param in twins.model.parameters():
                param.detach().sum()
        sim.synchronize()
        reserved.append(sim.memory_reserved())
        twins.assert_same(f"step {step}")
    assert not sim.races, sim.races
    assert reserved[2:] == reserved[1:-1], f"the staging took blocks of the hooks' stream's pool: {reserved}"


class _UnderPostReduce:
    """A plain model and optimizer, and a swapped twin (``step="in_backward"``) whose backward runs under a side
    stream, as FSDP2 runs the hooks under its post-reduce stream: a hook registered before the optimizer's
    rewrites each gradient there first, as a reduce-scatter writes it (lazy: still queued when the optimizer's
    hook runs)."""

    def __init__(self, sim: SimBackend, **options: object) -> None:
        self.plain_model, self.model = _model(), _model()
        self.plain = _rmsprop(self.plain_model)
        self.post_reduce = sim.new_stream()
        self.sim = sim
        for param in self.model.parameters():
            param.register_post_accumulate_grad_hook(self._rewrite)  # type: ignore[no-untyped-call]
        self.optimizer = _in_backward(self.model, sim, **options)

    def _rewrite(self, param: torch.Tensor) -> None:
        assert param.grad is not None
        self.sim.adopt(param.grad)  # device memory, as a reduce-scatter's output is
        with self.sim.compute_scope():
            param.grad.copy_(param.grad.clone())  # a write on the hook's (the current) stream

    def backward(self, step: int) -> None:
        """The plain optimizer's whole step; the swapped model's backward, under the side stream."""
        _forward(self.plain_model, _inputs(step)).backward()
        self.plain.step()
        self.plain.zero_grad(set_to_none=True)
        with self.sim.stream(self.post_reduce):
            _forward(self.model, _inputs(step)).backward()

    def assert_same(self, where: str) -> None:
        assert_trained_alike(self.plain_model, self.model, self.plain, self.optimizer, where)


@pytest.mark.figures
def test_freed_gradients_lower_the_peak_of_gradients_and_staging_and_stay_bitwise() -> None:
    """``free_gradients=True``: each batch's gradients go once its update is issued inside the backward, so the
    peak of gradient bytes plus device bytes (staging, resident states) during an iteration, measured at every
    gradient hook and around ``step()``, drops below the same mode keeping them, and below stepping after the
    backward. The parameters read ``None`` after the backward; the result stays bitwise."""
    peaks = {}
    for name, options in (
        ("after_backward", {"step": "after_backward"}),
        ("in_backward", {"step": "in_backward"}),
        ("in_backward, freed", {"step": "in_backward", "free_gradients": True}),
    ):
        plain_model, model = _deep_model(), _deep_model()
        plain = _rmsprop(plain_model)
        sim = SimBackend(mode="random", seed=8)
        meter = _GradientAndDeviceMeter(sim, list(model.parameters()))
        config = SwapConfig(backend=sim, swap_times=DEPTH, min_numel=16, **options)  # type: ignore[arg-type]
        optimizer = swap_optimizer(_rmsprop(model), config)
        meter.after_the_optimizers_hooks()
        for step in range(STEPS):
            _forward(plain_model, _inputs(step)).backward()
            plain.step()
            plain.zero_grad(set_to_none=True)
            meter.start()
            _forward(model, _inputs(step)).backward()
            gradient_bytes = 4 * sum(param.numel() for param in model.parameters())
            if name.endswith("freed") and step > 0:
                assert all(param.grad is None for param in model.parameters()), "every batch freed its gradients"
            meter.around(optimizer.step)
            optimizer.zero_grad(set_to_none=True)
            assert_trained_alike(plain_model, model, plain, optimizer, f"{name} step {step}")
        peaks[name] = meter.peak
    # One layer's gradients a batch: all but the two batches staged at a time are freed when the peak comes.
    assert peaks["in_backward"] - peaks["in_backward, freed"] >= gradient_bytes * (DEPTH - 3) // DEPTH, peaks
    assert peaks["in_backward, freed"] < peaks["after_backward"], peaks
    saved = peaks["in_backward"] - peaks["in_backward, freed"]
    quoted = (
        f"It is {peaks['after_backward']:,} bytes after the backward and inside it, and "
        f"{peaks['in_backward, freed']:,} bytes with the gradients freed. That saves {saved:,} of the "
        f"{gradient_bytes:,} gradient bytes."
    )
    page = " ".join((Path(__file__).resolve().parents[3] / "docs/step-in-backward.md").read_text().split())
    assert peaks["in_backward"] == peaks["after_backward"] and quoted in page, f"the page should say: {quoted}"


DEPTH = 8


def _deep_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), *(torch.nn.Linear(32, 32) for _ in range(DEPTH - 2)), torch.nn.Linear(32, 16)
    )


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "planted-unrecorded"])
def test_freed_gradients_under_another_stream_go_back_to_its_pool_only_after_the_update(
    recorded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hooks under another stream than the steps' (FSDP2's post-reduce stream), which wrote each gradient: a freed
    gradient's block goes back to that stream's pool, so it is kept from reuse until the update, issued to the
    steps' stream, read it (``free_when_done``: ``record_stream`` on a device). The simulator models the reuse as
    a write of the whole block; planted, without the record, it is on the hooks' stream at once, and the race
    checker reports the update's read of the gradient."""
    if not recorded:
        free_when_done = SimBackend.free_when_done

        def unrecorded(self: SimBackend, tensor: torch.Tensor, *, allocated_on: Stream, in_use_on: Stream) -> None:
            free_when_done(self, tensor, allocated_on=allocated_on, in_use_on=allocated_on)

        monkeypatch.setattr(SimBackend, "free_when_done", unrecorded)
    sim = SimBackend(mode="lazy", on_race="record")
    twins = _UnderPostReduce(sim, free_gradients=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: the gradients are freed, not kept
        for step in range(STEPS):
            twins.backward(step)
            freed = [param.grad is None for param in twins.model.parameters()]
            assert all(freed) == (step > 0), f"step {step}: freed {freed}"
            twins.optimizer.step()
            twins.optimizer.zero_grad(set_to_none=True)
            twins.assert_same(f"step {step}")
    reuses = [race for race in sim.races if "reuse of a freed block" in race]
    if recorded:
        assert not sim.races, sim.races
    else:
        assert reuses, sim.races


def test_free_gradients_needs_the_step_in_backward() -> None:
    with pytest.raises(
        ValueError, match=r"free_gradients=True\) .* needs step='in_backward', got step='after_backward'"
    ):
        SwapConfig(free_gradients=True)


class _GradientAndDeviceMeter:
    """The peak of (bytes of the parameters' gradients + the simulator's allocated device bytes) over the last
    iteration: sampled as each gradient is accumulated (before the optimizer's hook), across the optimizer's
    hook (the device's peak inside it, with the gradients alive before it), and across ``step()``."""

    def __init__(self, sim: SimBackend, params: list[torch.nn.Parameter]) -> None:
        self._sim, self._params = sim, params
        self.peak = 0
        self._gradients_before = 0
        for param in params:  # before the optimizer's own hooks: they run in the order registered
            param.register_post_accumulate_grad_hook(lambda _: self._before())  # type: ignore[no-untyped-call]

    def after_the_optimizers_hooks(self) -> None:
        for param in self._params:
            param.register_post_accumulate_grad_hook(lambda _: self._after())  # type: ignore[no-untyped-call]

    def start(self) -> None:
        self.peak = 0

    def around(self, step: Callable[[], object]) -> None:
        self._before()
        step()
        self._after()

    def _gradient_bytes(self) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in self._params if p.grad is not None)

    def _before(self) -> None:
        self._gradients_before = self._gradient_bytes()
        self._sim.reset_peak_memory_stats()
        self.peak = max(self.peak, self._gradients_before + self._sim.memory_allocated())

    def _after(self) -> None:
        self.peak = max(self.peak, self._gradients_before + self._sim.max_memory_allocated())


def test_a_traced_step_inside_the_backward_times_every_batch_from_its_first_hook() -> None:
    """``SwapConfig(trace=True)``: ``opt.trace`` holds each batch's copy-in, update and copy-out, in order, timed
    from the hook that began the step; the result stays bitwise."""
    plain_model, model = _model(), _model()
    plain = _rmsprop(plain_model)
    optimizer = _in_backward(model, SimBackend(mode="random", seed=10), trace=True)
    for step in range(3):
        _forward(plain_model, _inputs(step)).backward()
        plain.step()
        plain.zero_grad(set_to_none=True)
        _forward(model, _inputs(step)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert_trained_alike(plain_model, model, plain, optimizer, f"step {step}")
        assert optimizer.trace is not None
        spans = {(interval.batch, interval.phase): interval for interval in optimizer.trace}
        assert sorted(spans) == [(batch, phase) for batch in range(3) for phase in ("d2h", "h2d", "update")], spans
        for batch in range(3):
            copy_in, update, copy_out = (spans[batch, phase] for phase in ("h2d", "update", "d2h"))
            assert 0 <= copy_in.start <= copy_in.end <= update.start <= update.end <= copy_out.start, spans
    assert optimizer.stats.batches_in_backward == 3


def test_accumulated_micro_batches_update_once_in_the_last_backward() -> None:
    plain_model, model = _model(), _model()
    plain = _rmsprop(plain_model)
    sim = SimBackend(mode="random", seed=2)
    optimizer = _in_backward(model, sim)
    for step in range(STEPS):
        for micro_batch in range(3):
            _forward(plain_model, _inputs(step, micro_batch)).backward()
        plain.step()
        plain.zero_grad(set_to_none=True)
        with optimizer.accumulating():
            for micro_batch in range(2):
                copies_before = sim.copy_stats.h2d_copies
                _forward(model, _inputs(step, micro_batch)).backward()
                assert sim.copy_stats.h2d_copies == copies_before, "a micro-batch before the last updated nothing"
        _forward(model, _inputs(step, 2)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert_trained_alike(plain_model, model, plain, optimizer, f"step {step}")


def test_backwards_accumulated_before_the_first_step_without_accumulating_are_refused_before_anything_changes() -> None:
    """A loop that accumulates micro-batches without ``opt.accumulating()`` (torchtune's and torchtitan's do) is
    refused at its first step, which runs after the backward, instead of at its second, after the first
    micro-batch's backward updated every batch."""
    twin_model, model = _model(), _model()
    optimizer = _in_backward(model, SimBackend(mode="lazy"))
    for micro_batch in range(2):
        _forward(model, _inputs(0, micro_batch)).backward()
    with pytest.raises(SwapStateError, match=r"accumulated over several backwards .* before anything changed"):
        optimizer.step()
    _assert_never_stepped(twin_model, model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    with optimizer.accumulating():
        _forward(model, _inputs(1, 0)).backward()
    _forward(model, _inputs(1, 1)).backward()
    optimizer.step()


def test_a_second_backward_without_accumulating_is_refused_naming_the_fix() -> None:
    """Without provisional updates: the second backward reaches a gradient whose batch updated already."""
    model = _model()
    optimizer = _in_backward(model, SimBackend(), provisional_updates=False)
    _forward(model, _inputs(0)).backward()
    optimizer.step()
    _forward(model, _inputs(1)).backward()  # updates the batches inside the backward
    with pytest.raises(SwapStateError, match=r"after its batch was updated with it .* `with opt\.accumulating\(\):`"):
        _forward(model, _inputs(2)).backward()


def test_a_gradient_clipped_after_the_backward_is_refused_at_step() -> None:
    """The update used the gradients as the backward left them: clipping afterwards cannot reach it, and step()
    says so instead of letting the loop believe it clipped."""
    model = _model()
    optimizer = _in_backward(model, SimBackend(), provisional_updates=False)
    _forward(model, _inputs(0)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _forward(model, _inputs(1)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    with pytest.raises(
        SwapStateError, match=r"changed after their batch updated inside the backward .* clip_grad_norm_"
    ):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _forward(model, _inputs(2)).backward()  # the next iteration runs
    optimizer.step()


@pytest.mark.parametrize("how", ["scheduler", "pre_hook", "tensor_in_place"])
def test_hyperparameters_changed_before_step_are_refused_after_a_step_with_the_values_it_began_with(how: str) -> None:
    """An LR scheduler stepped before the optimizer, a step pre-hook that sets ``lr``, or a tensor ``lr`` written in
    place: the batches inside the backward already used the old value. The step ends with it throughout (bitwise
    the plain optimizer at the old value), step() refuses naming the change, and the new value applies from the
    next step."""
    tensor_lr = how == "tensor_in_place"
    plain_model, model = _model(), _model()
    plain = _rmsprop_with_lr(plain_model, tensor_lr=tensor_lr)
    optimizer = swap_optimizer(
        _rmsprop_with_lr(model, tensor_lr=tensor_lr),
        SwapConfig(
            backend=SimBackend(mode="random", seed=7),
            swap_times=3,
            min_numel=32,
            step="in_backward",
            provisional_updates=False,
        ),
    )
    scheduler, _ = (torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in (optimizer, plain))
    for step in range(4):
        # At step 2 the first weight gets no gradient: its batch is left to step(), which must use the old value.
        loss = _without_the_first_weight if step == 2 else _forward
        loss(plain_model, _inputs(step)).backward()
        plain.step()
        plain.zero_grad(set_to_none=True)
        loss(model, _inputs(step)).backward()
        if step == 2:
            if how == "scheduler":
                scheduler.step()  # before optimizer.step(): its lr is for this step
            elif how == "pre_hook":
                optimizer.register_step_pre_hook(_halving_lr_once())
            else:
                optimizer.param_groups[0]["lr"].fill_(0.005)
            with pytest.raises(SwapStateError, match=r"param_groups\[0\]\['lr'\]: .* -> .*with SwapConfig\(step="):
                optimizer.step()
            for group in plain.param_groups:  # the plain twin takes the new value after this step
                _set_lr(group, 0.005)
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert_trained_alike(plain_model, model, plain, optimizer, f"{how} step {step}")
    assert _lr(optimizer.param_groups[0]) == pytest.approx(0.005)


def _without_the_first_weight(model: torch.nn.Sequential, inputs: torch.Tensor) -> torch.Tensor:
    """The first layer's weight detached: no gradient for it, one for its bias (in the same batch)."""
    first = model[0]
    assert isinstance(first, torch.nn.Linear)
    hidden = torch.nn.functional.linear(inputs, first.weight.detach(), first.bias)
    for layer in list(model)[1:]:
        hidden = layer(hidden)
    return hidden.square().mean()


def _rmsprop_with_lr(model: torch.nn.Module, *, tensor_lr: bool) -> torch.optim.Optimizer:
    lr: float | torch.Tensor = torch.tensor(0.01) if tensor_lr else 0.01
    return torch.optim.RMSprop(model.parameters(), lr=lr, momentum=0.9)


def _halving_lr_once() -> Callable[..., None]:
    def halve(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if not done:
            done.append(True)
            for group in optimizer.param_groups:
                group["lr"] = 0.005

    done: list[bool] = []
    return halve


def _set_lr(group: dict[str, object], value: float) -> None:
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        lr.fill_(value)
    else:
        group["lr"] = value


def _lr(group: dict[str, object]) -> float:
    lr = group["lr"]
    return float(lr) if isinstance(lr, torch.Tensor) else lr  # type: ignore[arg-type]


@pytest.mark.parametrize("unscaled_first", [False, True], ids=["step", "unscale_then_step"])
def test_grad_scaler_is_refused_at_the_first_step_before_anything_changes(unscaled_first: bool) -> None:
    """``GradScaler`` unscales the gradients and skips steps with inf after the backward, too late for batches that
    update inside it. The first step runs after the backward, so the refusal comes before any update: the model
    and the optimizer stay as a twin that never stepped, and the loop goes on without the scaler."""
    twin_model, model = _model(), _model()
    optimizer = _in_backward(model, SimBackend(mode="lazy"), provisional_updates=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scaler.scale(_forward(model, _inputs(0))).backward()
    if unscaled_first:
        scaler.unscale_(optimizer)
    refused = r"GradScaler cannot drive .*Nothing was updated\. .*step='after_backward'"
    with pytest.raises(SwapStateError, match=refused):
        scaler.step(optimizer)
    _assert_never_stepped(twin_model, model, optimizer)
    assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")
    optimizer.zero_grad(set_to_none=True)
    _forward(model, _inputs(1)).backward()
    optimizer.step()


def test_grad_scaler_brought_in_later_is_refused_saying_what_the_backward_updated() -> None:
    model = _model()
    optimizer = _in_backward(model, SimBackend(mode="random", seed=9), provisional_updates=False)
    for step in range(2):
        _forward(model, _inputs(step)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scaler.scale(_forward(model, _inputs(2))).backward()  # updates every batch inside it, with scaled gradients
    with pytest.raises(SwapStateError, match=r"This step's batches updated inside the backward with the scaled"):
        scaler.step(optimizer)
    optimizer.state_dict()  # the step ended: the state can be read again
    optimizer.zero_grad(set_to_none=True)
    _forward(model, _inputs(3)).backward()
    optimizer.step()


def test_a_gradient_clipped_after_the_first_backward_is_refused_before_anything_changes() -> None:
    """The first step runs after the backward, but the hooks saw the gradients: one edited since is refused then,
    before any state exists, instead of at the next step after batches updated with unclipped gradients."""
    twin_model, model = _model(), _model()
    optimizer = _in_backward(model, SimBackend(mode="lazy"), provisional_updates=False)
    _forward(model, _inputs(0)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    with pytest.raises(SwapStateError, match=r"changed between the backward and step\(\) .* refused now, before"):
        optimizer.step()
    _assert_never_stepped(twin_model, model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    _forward(model, _inputs(1)).backward()  # the loop goes on without clipping
    optimizer.step()


def test_the_state_is_refused_between_a_backward_that_updated_batches_and_step() -> None:
    """Some batches already stepped: a checkpoint or a read then would mix two steps. Refused, and the step then
    ends as if nothing happened."""
    plain_model, model = _model(), _model()
    plain = _rmsprop(plain_model)
    optimizer = _in_backward(model, SimBackend(mode="lazy"), provisional_updates=False)
    for step in range(3):
        _forward(plain_model, _inputs(step)).backward()
        plain.step()
        plain.zero_grad(set_to_none=True)
        _forward(model, _inputs(step)).backward()
        if step > 0:
            first = next(iter(model.parameters()))
            with pytest.raises(SwapStateError, match=r"being updated inside the backward .* call step\(\) before"):
                optimizer.state[first]
            with pytest.raises(SwapStateError, match=r"call step\(\) before reading, saving or editing them"):
                optimizer.state_dict()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert_trained_alike(plain_model, model, plain, optimizer, f"step {step}")


def test_a_parameter_without_gradient_is_skipped_as_torch_skips_it_and_keeps_the_steps_after_the_backward() -> None:
    """Without a state (it never had a gradient) the batches cannot update inside the backward: the steps run after
    it, bitwise, and a warning says why once."""
    plain_model, model = _model(unused_layer=True), _model(unused_layer=True)
    plain = _rmsprop(plain_model)
    sim = SimBackend(mode="random", seed=4)
    optimizer = _in_backward(model, sim)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            _forward(plain_model, _inputs(step), unused_layer=True).backward()
            plain.step()
            plain.zero_grad(set_to_none=True)
            copies_before = sim.copy_stats.h2d_copies
            _forward(model, _inputs(step), unused_layer=True).backward()
            assert sim.copy_stats.h2d_copies == copies_before, "no batch moved inside the backward"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            assert_trained_alike(plain_model, model, plain, optimizer, f"step {step}")
    assert model[-1].weight not in optimizer.state
    messages = [str(warning.message) for warning in caught if "have no optimizer state yet" in str(warning.message)]
    assert len(messages) == 1 and "2 parameter(s)" in messages[0] and "(16, 16)" in messages[0], messages
    assert all(warning.filename == __file__ for warning in caught if "no optimizer state" in str(warning.message))


def test_master_weights_update_inside_the_backward_bitwise_the_plain_optimizer_over_fp32_masters() -> None:
    reference_model, model = _model().to(torch.bfloat16), _model().to(torch.bfloat16)
    reference = MasterReference(list(reference_model.parameters()), _rmsprop_of)
    sim = SimBackend(mode="random", seed=5)
    optimizer = _in_backward(model, sim, master_weights=True)
    for step in range(STEPS):
        _forward(reference_model, _inputs(step).to(torch.bfloat16)).backward()
        reference.step()
        reference_model.zero_grad(set_to_none=True)
        copies_before = sim.copy_stats.h2d_copies
        _forward(model, _inputs(step).to(torch.bfloat16)).backward()
        assert (sim.copy_stats.h2d_copies > copies_before) == (step > 0), step
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference.assert_matches(optimizer, list(model.parameters()), f"step {step}")


@pytest.mark.filterwarnings("error")
def test_a_load_and_a_new_param_group_are_taken_in_by_the_next_backward() -> None:
    """A checkpoint loaded between steps updates inside the next backward, bitwise; parameters of a group added
    later get their hooks at the step that creates their states, and every batch then updates inside the backward."""
    plain_model, model = _model(), _model()
    plain = _rmsprop(plain_model)
    optimizer = _in_backward(model, SimBackend(mode="random", seed=3))
    extra_plain, extra = (torch.nn.Linear(16, 16) for _ in range(2))
    extra.load_state_dict(extra_plain.state_dict())
    for step in range(STEPS):
        if step == 2:
            optimizer.load_state_dict(through_torch_save(plain.state_dict()))
        if step == 3:
            plain.add_param_group({"params": list(extra_plain.parameters())})
            optimizer.add_param_group({"params": list(extra.parameters())})
        for this_model, head, this_opt in ((plain_model, extra_plain, plain), (model, extra, optimizer)):
            loss = _forward(this_model, _inputs(step))
            (loss + (head(_inputs(step)).square().mean() if step >= 3 else 0)).backward()
            this_opt.step()
            this_opt.zero_grad(set_to_none=True)
        assert_trained_alike(plain_model, model, plain, optimizer, f"step {step}")
        in_backward = {0: 0, 3: 0}.get(step, optimizer.stats.batches)  # states made at step 0 and for the group at 3
        assert optimizer.stats.batches_in_backward == in_backward, (step, optimizer.stats)


def test_a_layer_unfrozen_later_gets_its_hooks_and_updates_inside_the_backward() -> None:
    """Gradual unfreezing: a parameter frozen at wrapping has no hook (none can be registered); once it requires a
    gradient, the step that makes its state hooks it, and from the next one every batch updates inside the
    backward again, bitwise."""
    plain_model, model = _model(), _model()
    for frozen in (plain_model[0], model[0]):
        frozen.requires_grad_(False)
    plain = _rmsprop(plain_model)
    optimizer = _in_backward(model, SimBackend(mode="random", seed=11))
    for step in range(5):
        if step == 2:
            for unfrozen in (plain_model[0], model[0]):
                unfrozen.requires_grad_(True)
        for this_model, this_opt in ((plain_model, plain), (model, optimizer)):
            _forward(this_model, _inputs(step)).backward()
            this_opt.step()
            this_opt.zero_grad(set_to_none=True)
        assert_trained_alike(plain_model, model, plain, optimizer, f"step {step}")
        if step in (1, 4):  # after the first step, and after the one that made the unfrozen layer's state
            assert optimizer.stats.batches_in_backward == optimizer.stats.batches, (step, optimizer.stats)


def _assert_never_stepped(twin_model: torch.nn.Module, model: torch.nn.Module, optimizer: SwapOptimizer) -> None:
    """After a refusal at the first step: the parameters as the twin's that never stepped, and no state."""
    for (name, expected), actual in zip(twin_model.named_parameters(), model.parameters(), strict=True):
        assert_bitwise_equal(expected, actual, f"after the refusal: {name}")
    assert not optimizer.state


def _rmsprop_of(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(params, lr=1e-2, momentum=0.9, weight_decay=0.01)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"prefetch": "backward"}, r"does not support prefetch='backward' yet: it copies each batch in"),
        (
            {"undo_failed_steps": True, "provisional_updates": False},
            r"does not support undo_failed_steps=True yet: with provisional_updates=False",
        ),
    ],
)
def test_what_the_mode_does_not_support_yet_is_refused_naming_it(option: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SwapConfig(step="in_backward", **option)  # type: ignore[arg-type]


def test_an_unknown_step_mode_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Invalid SwapConfig.step: 'during'; expected one of"):
        SwapConfig(step="during")  # type: ignore[arg-type]
