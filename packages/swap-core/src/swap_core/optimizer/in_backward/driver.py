"""``SwapConfig(step="in_backward")``: each batch updates inside the backward, as soon as its gradients are final.

The contract, in one place:

- A post-accumulate-grad hook on every parameter marks its gradient final. The plan walks its batches in the order
  a backward finalizes gradients (the last parameters first); when every parameter of the walk's next batch that
  takes a gradient has a final one, the batch is copied in (the one after it too), updated and copied out, inside
  the hook, on the stream the step began on. The rest of the backward runs meanwhile. A parameter that has a
  gradient but takes none in this backward (frozen, its gradient zeroed and kept) is never final inside it: its
  batch waits for ``step()``. A gradient accumulated in a reentrant backward (a checkpoint's, ``use_reentrant=True``)
  is final when the outer backward ends (:mod:`.backwards`).
- With ``SwapConfig(provisional_updates=True)`` (the default) those updates are provisional (:mod:`.commit`): each
  batch copies its states out to the spare host copies and keeps its parameters and resident states. ``step()``
  commits when nothing the updates read changed since; otherwise it takes them back and steps again after the
  backward, with the gradients and values as they are then (``clip_grad_norm_``, ``GradScaler``, an LR scheduler
  stepped first: bitwise the plain loop). A backward that raises, one abandoned without ``step()`` (taken back at
  ``zero_grad()``, at the next backward, or when the optimizer is closed or collected) and a failure inside a hook
  take them back too. Without provisional updates such edits are refused at ``step()``, after the fact.
- Gradient accumulation: the backwards of the micro-batches before the last run inside ``opt.accumulating()``, where
  the hooks update nothing. A later backward that finds a step begun in an earlier one (the loop ran a forward over
  the updated parameters) takes the step back and raises from its hook, naming the fix.
- The first step, which creates the states, runs after the backward; so does every step while some parameter has
  no state. A load, an edit of the state or a new param group is taken in at the first hook of the next backward
  (as ``step()`` takes it in); one ``step()`` would refuse stops no batch there, and ``step()`` raises it.
- The hooks hold the optimizer weakly and go when it is garbage collected.

The step is the skeleton of every driver (:mod:`swap_core.optimizer.step_driver`): it is planned and its walk begun
in the hook that finds the first batch ready (with ``swap_times="auto"``, an out-of-memory there before any update
began re-plans once with twice the batches and the backward goes on), advanced in the hooks, ended in ``step()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable
from typing import NoReturn

import torch
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from ...adapters.base import StateSwapAdapter
from ...errors import SwapStateError
from ...nesting import NestedFlag
from ...runtime.plan import SwapPlan
from ...runtime.update_undo import UpdateUndo
from ...stats import SwapStats
from ..plan_cache import PlanCache
from ..setup import SwapSetup
from ..state_sync import StateSync
from ..step_driver import StepDriver, StepOutcome
from .backwards import BackwardWatch, HookPlace
from .commit import (
    AmpScaling,
    Started,
    TakeBack,
    commit,
    end_as_begun,
    refuse_edits_since_the_backward,
    stepped_again,
    why_not_commit,
)
from .gradient_watch import GradientWatch
from .group_snapshot import GroupSnapshot
from .refusals import (
    LATER_BACKWARD,
    grad_scaler_refused,
    params_written_refused,
    refuse_what_changed_after_the_fact,
    warn_of_stateless_params,
)
from .run import InBackwardRun

__all__ = ["InBackward"]

_HOOKED_BY: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Each parameter an in-backward driver hooks, and the newest such driver (weakly): it alone updates the parameter
inside the backward. An older one still alive (dropped by the user but kept by a reference cycle, or kept on
purpose) steps it after the backward, at its own ``step()``, as torch's would: two would update it twice."""


@dataclasses.dataclass
class _SinceStep:
    """What the backwards since the last ``step()`` did (replaced at every ``step()``)."""

    final: set[int] = dataclasses.field(default_factory=set)
    """The parameters whose gradient is final in this backward."""
    deferred: set[int] = dataclasses.field(default_factory=set)
    """Parameters whose gradient a nested (reentrant) backward accumulated: final when the outer one ends."""
    started: Started | None = None
    cannot_begin: bool = False
    """No step can begin in this backward (found at its first hook): the rest of it tries no more."""
    seen: GradientWatch = dataclasses.field(default_factory=GradientWatch)
    """The gradients of a backward in which no step began, as their hooks saw them."""
    repeated: bool = False
    """A hook saw a gradient it had seen since the last ``step()`` (backwards accumulating outside
    :meth:`InBackward.accumulating`)."""
    backwards: BackwardWatch = dataclasses.field(default_factory=BackwardWatch)


class InBackward(StepDriver):
    """The step driver of ``SwapConfig(step="in_backward")``: the gradient hooks and the step they begin (see the
    module)."""

    claims_amp_scaling = True
    """``GradScaler`` hands ``step()`` its scale: the batches updated before it could unscale or skip."""
    updates_resident_first = False
    """Every parameter updates with its batch, once its gradient is final."""
    walks_last_batch_first = True
    """The batches are walked in the order a backward finalizes gradients (the last parameters first)."""
    updates_before_step = True

    @classmethod
    def check_supported(cls, adapter: StateSwapAdapter, params: list[torch.Tensor]) -> None:
        """Refuse, before anything changes, what ``step="in_backward"`` does not support yet, naming the way out."""
        if adapter.partition_costs(params) is not None:
            raise ValueError(
                f"SwapConfig(step='in_backward') cannot run {type(adapter).__name__}: every rank walks all its "
                "batches together (a distributed family), so no batch can update on its own inside the backward; use "
                "step='after_backward'"
            )

    def __init__(self, owner: object, setup: SwapSetup, sync: StateSync, plans: PlanCache) -> None:
        """The hooks go when ``owner`` (the optimizer) is collected."""
        super().__init__(owner, setup, sync, plans)
        self._now = _SinceStep()
        self._accumulating = NestedFlag()
        self._hooks = HookHandles()
        self._hooked: set[int] = set()
        self._warned = False
        self._undo = UpdateUndo(setup.backend) if setup.provisional_updates else None
        self._take_back = TakeBack(setup.scheduler, self._undo) if self._undo is not None else None
        self._amp: AmpScaling | None = None
        self._freed: list[torch.Tensor] = []
        """Parameters whose gradients ``free_gradients`` dropped since the last ``zero_grad()``."""
        if self._undo is not None:  # a read of the state between backward() and step() sees the state before it
            setup.scheduler.take_back_for_the_host = _weakly(self._taken_back_for_the_host)
        self.hook_params(sync.ordered_params())

    def hook_params(self, params: list[torch.Tensor]) -> None:
        """A post-accumulate-grad hook on each of ``params`` that takes a gradient (the others are never waited for)."""
        self.remove_hooks()
        self._hooked = {id(param) for param in params if _takes_gradients(param)}
        this = weakref.ref(self)
        for param in params:
            if _takes_gradients(param):
                hook = param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    lambda param, this=this: _gradient_final(this, param)
                )
                self._hooks.add(param, hook, this)

    def remove_hooks(self) -> None:
        self._hooks.remove()

    def what_goes_when_collected(self) -> list[Callable[[], object]]:
        """What the optimizer's finalizer runs: the hooks removed, an open provisional step taken back (neither holds
        the optimizer)."""
        return [self._hooks.remove, *([self._take_back] if self._take_back is not None else [])]

    def release(self) -> None:
        """The optimizer is closed or collected: the hooks go, and a step still open is taken back (or, without
        provisional updates, ends where it is)."""
        self.remove_hooks()
        with self.setup.scheduler.working():
            self.take_back_open_step(unless_committed=False)

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        """The backwards inside update nothing (micro-batches before the last one of an accumulated step)."""
        return self._accumulating.raised()

    @property
    def transfers_started(self) -> bool:
        """Whether the next ``step()``'s copies began before it: a prefetch's copy-in, or batches updated inside the
        backward (the step's transfer window then began there)."""
        return self.setup.scheduler.prefetched or self._now.started is not None

    # -- inside the backward ---------------------------------------------------------------
    def gradient_final(self, param: torch.Tensor) -> None:
        """A gradient is final: update the batches it completes (begin the step at the first)."""
        if self._accumulating:
            return
        now = self._now
        place = now.backwards.place(self._outer_backward_ended)
        if place is HookPlace.LATER and now.started is not None and now.started.walk.to_spare:
            self._refuse_a_later_backward(now)
        if place is HookPlace.NESTED:
            now.deferred.add(id(param))
            return
        if now.started is not None and now.started.run.applied(param):
            self.take_back_open_step(unless_committed=False)
            raise SwapStateError(
                f"A backward accumulated into the gradient of a parameter of shape {tuple(param.shape)} after its "
                "batch was updated with it (SwapConfig(step='in_backward')): run the backwards of the micro-batches "
                "before the last one inside `with opt.accumulating():`, or call step() after each backward"
            )
        now.final.add(id(param))
        self._update_what_is_ready(now, param)

    def _outer_backward_ended(self) -> None:
        """The outer backward ended: the gradients its nested backwards accumulated are final too."""
        now = self._now
        if now.deferred and not self._accumulating:
            now.final |= now.deferred
            now.deferred = set()
            self._update_what_is_ready(now, None)

    def _update_what_is_ready(self, now: _SinceStep, param: torch.Tensor | None) -> None:
        """Begin the step if none began (plan, begin the walk), then update every batch ready; an out-of-memory
        before any update began re-plans once (:meth:`PlanCache.retry_after`). A failure takes the step back."""
        with self.setup.scheduler.working(), torch.no_grad():  # a backward with create_graph=True records its ops
            for retried in (False, True):
                try:
                    started = now.started or (None if now.cannot_begin else self._begin(now))
                    if started is None:
                        if param is not None:
                            self._note_unstepped(now, param)
                        return
                    self._update_ready_batches(now, started)
                    return
                except BaseException as error:
                    begun = now.started.run.updates_begun if now.started is not None else 0
                    self.take_back_open_step(unless_committed=False)
                    if not self.plans.retry_after(error, updates_begun=begun, retried=retried):
                        now.final = set()
                        raise

    def _update_ready_batches(self, now: _SinceStep, started: Started) -> None:
        walk, scheduler, free = started.walk, self.setup.scheduler, self.setup.free_gradients
        ordered = False
        while (batch := walk.next_batch) is not None and _ready(now.final, batch.params):
            if not ordered:
                _order_after_the_hooks_stream(self.setup)
                ordered = True
            scheduler.advance(walk)
            started.stats.batches_in_backward += 1
            if self._take_back is not None:
                self._take_back.groups_after = GroupSnapshot(self.sync.param_groups)
            if free:
                started.run.free_gradients(batch, allocated_on=self.setup.backend.compute_stream())
                self._freed += [param for _, param in batch.params if param.grad is None]

    def _note_unstepped(self, now: _SinceStep, param: torch.Tensor) -> None:
        """No step began in this backward: the gradient is noted, so that ``step()`` refuses it edited (or
        accumulated over several backwards) before anything changes."""
        if param.grad is not None:
            now.repeated = now.repeated or param in now.seen  # a second backward since step()
            now.seen.note(param, param.grad, bits=self._undo is None)  # edits refused without provisional updates

    def _begin(self, now: _SinceStep) -> Started | None:
        """Plan the step over the state as it is now (after the user's edits) and begin its walk, if the plan has
        batches and every parameter that requires a gradient has its state; else ``None`` for the rest of this
        backward (``step()`` runs the step after it, and raises what planning refused, before any change)."""
        run = InBackwardRun(self.setup, self.sync, self.plans, self._undo)
        try:
            plan = run.prepare()
        except torch.OutOfMemoryError:
            if self.setup.batch_count.replans_after_out_of_memory:
                raise  # re-planned with more batches, once
            plan = None
        except Exception:  # a refused edit or state
            plan = None
        if plan is None or not plan.batches or not (plan.all_states_exist or _states_of_every_trained_param(self.sync)):
            run.release()
            now.cannot_begin = True
            return None
        return self._start(now, run, plan)

    def _start(self, now: _SinceStep, run: InBackwardRun, plan: SwapPlan) -> Started:
        """Begin the walk over ``plan`` (its first copy-in issued), on the stream the steps run on, not the hook's
        (FSDP2's post-reduce stream): the staging belongs there."""
        setup = self.setup
        scope = contextlib.ExitStack()
        provisional = self._take_back is not None
        try:
            with setup.backend.stream(setup.scheduler.compute):
                scope.enter_context(setup.adapter.step_scope())
                stats, trace = SwapStats(), setup.new_trace()
                if not setup.scheduler.prefetched:  # else opt.prefetch() started it: its copy-in is this step's first
                    setup.backend.start_transfer_window()
                on_copy_in = run.keep_params if provisional else None
                traced = trace is not None
                walk = setup.scheduler.begin(
                    plan, run.update, stats, traced=traced, provisional=provisional, on_copy_in=on_copy_in
                )
        except BaseException:
            scope.close()
            run.release()
            raise
        groups = GroupSnapshot(self.sync.param_groups)
        now.started = Started(run, walk, stats, scope, groups, trace)
        if self._take_back is not None:
            self._take_back.opened(plan, groups, self.sync.param_groups)
        return now.started

    def before_zero_grad(self, *, set_to_none: bool) -> None:
        """A step begun inside the backward and not ended is skipped: taken back. Gradients ``free_gradients``
        dropped come back as zeros where ``zero_grad(set_to_none=False)`` keeps zeroed ones (as the plain optimizer's
        parameters have them: a layer that takes no gradient in the next backward steps with zeros, as in torch)."""
        self.take_back_open_step()
        self._now = _SinceStep()
        freed, self._freed = self._freed, []
        if not set_to_none:
            for param in freed:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)

    def finished(self, outcome: StepOutcome) -> StepOutcome:
        outcome = super().finished(outcome)
        if self._undo is not None:
            outcome.stats.host_param_copy_bytes = self._undo.host_bytes
        return outcome

    def take_back_open_step(
        self, *, unless_committed: bool = True, left_to_a_step: Callable[[torch.Tensor], bool] | None = None
    ) -> bool:
        """Take back what a step begun inside the backward updated, if one is open and provisional (its walk ended,
        its parameters, resident states and group values as they were before it); whether one was. A step whose
        updates are not provisional stays open for ``step()`` to end, unless ``unless_committed`` is false (its walk
        failed, or the optimizer goes): then it ends where it is, what it updated kept."""
        now = self._now
        started = now.started
        if started is None or (unless_committed and self._take_back is None):
            return False
        now.started = None
        try:
            if self._take_back is not None:
                return self._take_back(left_to_a_step=left_to_a_step)
            self.setup.scheduler.abandon(started.walk)
            return False
        finally:
            started.close()

    def _taken_back_for_the_host(self) -> None:
        self.take_back_open_step()

    def _refuse_a_later_backward(self, now: _SinceStep) -> NoReturn:
        """A backward began while a step begun in an earlier one is open: the loop ran a forward over its updated
        parameters. The step is taken back, and the backward refused."""
        self.take_back_open_step()
        self._now = _SinceStep()
        raise SwapStateError(LATER_BACKWARD)

    # -- step() ---------------------------------------------------------------------------
    def take_amp_scaling(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """``GradScaler.step`` hands this step its scale (``None``: the gradients were unscaled already) and whether a
        gradient holds an inf or a NaN: the step takes back what the backward updated with scaled gradients, then
        skips or steps with them unscaled, as ``GradScaler`` would have. Refused without provisional updates."""
        if self._undo is None:
            self._refuse_amp_scaling()
        self._amp = AmpScaling(grad_scale, found_inf)

    def step(self) -> StepOutcome:
        """``step()`` after a step began inside the backward: commit it, or take it back and step after the backward;
        the step after the backward when none began."""
        now, self._now = self._now, _SinceStep()
        amp, self._amp = self._amp, None
        with self.setup.scheduler.working():  # reads of the state here wait for nothing
            self._hook_new_params()
            started = now.started
            if started is not None and self._undo is not None:
                reasons, skips = self._why_not_commit(now, started, amp)
                if not reasons:
                    return self._commit(started)
                taken_back = started.stats.batches_in_backward
                steps_again = not skips and not (self.setup.free_gradients and taken_back)
                now.started = started
                self._now = now  # take_back_open_step reads the open step
                self.take_back_open_step(left_to_a_step=stepped_again(self.sync) if steps_again else None)
                self._now = _SinceStep()
                return self._step_again(reasons, taken_back, amp, skips=skips)
            if started is None:
                refuse_edits_since_the_backward(
                    now.seen,
                    now.repeated,
                    provisional=self._undo is not None,
                    read_to_host=self.setup.backend.read_to_host,
                )
                self._warned = self._warned or warn_of_stateless_params(self.sync)
                if amp is not None and amp.skips():
                    return self.skipped()
                if amp is not None:
                    amp.unscale(self.sync.ordered_params())
                return super().step()
            return self._end_unprovisional(started)

    def _why_not_commit(self, now: _SinceStep, started: Started, amp: AmpScaling | None) -> tuple[list[str], bool]:
        """What keeps the open step from committing, and whether ``GradScaler`` skips it; should finding out fail (a
        read of the device), the step is taken back before the error propagates. Parameters written between backward()
        and step() after their provisional update are refused so: torch's step would update the edited values, which
        no longer exist (the edit is taken back with the step)."""
        try:
            edited = started.run.edited_params()
            if edited:
                raise params_written_refused(edited)
            return why_not_commit(started, self.sync, amp), amp is not None and amp.skips()
        except BaseException:
            self._now = now
            self.take_back_open_step()
            self._now = _SinceStep()
            raise

    def _commit(self, started: Started) -> StepOutcome:
        assert self._take_back is not None
        commit(started, self.setup.scheduler, self.sync, self._take_back)
        return self.finished(started.outcome())

    def _step_again(self, reasons: list[str], taken_back: int, amp: AmpScaling | None, *, skips: bool) -> StepOutcome:
        """The provisional updates were taken back (``reasons``): the step runs after the backward, with the gradients
        and values as they are now (``GradScaler``'s skip, ``skips``, or unscale first)."""
        if self.setup.free_gradients and taken_back:
            raise SwapStateError(
                f"The step begun inside the backward cannot commit ({reasons[0]}) and cannot run again: "
                "SwapConfig(free_gradients=True) dropped the gradients it used. It was taken back (nothing changed). "
                "Keep the gradients (free_gradients=False) to edit them between backward() and step()"
            )
        if skips:
            return self.skipped()
        assert self._take_back is not None
        try:
            if amp is not None:
                amp.unscale(self.sync.ordered_params())
            outcome = super().step()
        except BaseException:
            self._take_back.stepped_again(failed=True)
            raise
        self._take_back.stepped_again(failed=False)
        outcome.stats.batches_taken_back = taken_back
        return outcome

    def _end_unprovisional(self, started: Started) -> StepOutcome:
        """Without provisional updates: the rest of the step as it began, then what changed since is refused."""
        changed, edited = end_as_begun(started, self.setup.scheduler, self.sync.param_groups)
        outcome = self.finished(started.outcome())
        refuse_what_changed_after_the_fact(changed, edited, outcome.stats.batches_in_backward)
        return outcome

    def _refuse_amp_scaling(self) -> NoReturn:
        """``GradScaler.step`` called this optimizer without provisional updates: raise, after ending a step that
        began inside the backward."""
        started, self._now = self._now.started, _SinceStep()
        if started is not None:  # GradScaler's inf check wrote the gradients; the step ends as it began
            with self.setup.scheduler.working(), contextlib.suppress(SwapStateError):
                self._end_unprovisional(started)
        raise grad_scaler_refused(updated=started is not None)

    def _hook_new_params(self) -> None:
        """A group added, params replaced or unfrozen: hooks on them."""
        params = self.sync.ordered_params()
        if {id(param) for param in params if _takes_gradients(param)} != self._hooked:
            self.hook_params(params)


class HookHandles:
    """The gradient hooks of a driver, removable without it (its optimizer's finalizer removes them)."""

    def __init__(self) -> None:
        self._handles: list[tuple[torch.Tensor, RemovableHandle, weakref.ref[InBackward]]] = []

    def __len__(self) -> int:
        return len(self._handles)

    def add(self, param: torch.Tensor, handle: RemovableHandle, driver: weakref.ref[InBackward]) -> None:
        self._handles.append((param, handle, driver))
        _HOOKED_BY[param] = driver

    def remove(self) -> None:
        """Every hook removed, and the parameters free for another driver."""
        for param, handle, driver in self._handles:
            handle.remove()
            newest = _HOOKED_BY.get(param)  # type: ignore[no-untyped-call]
            if newest is not None and newest() is driver():
                del _HOOKED_BY[param]
        self._handles = []


def _weakly(method: Callable[[], object]) -> Callable[[], None]:
    """``method`` held weakly (nothing of the driver is kept alive by whoever holds this)."""
    reference = weakref.WeakMethod(method)

    def call() -> None:
        live = reference()
        if live is not None:
            live()

    return call


def _states_of_every_trained_param(sync: StateSync) -> bool:
    """Whether every parameter that requires a gradient has its state (frozen ones never get one)."""
    return all(sync.state.get(param) for param in sync.ordered_params() if param.requires_grad)


def _order_after_the_hooks_stream(setup: SwapSetup) -> None:
    """Order the steps' stream after the stream this hook runs under, when they differ: FSDP2 runs the hooks under
    its post-reduce stream, where the reduce-scatter that wrote the gradient may still be running."""
    backend, steps_stream = setup.backend, setup.scheduler.compute
    hooks_stream = backend.compute_stream()
    if hooks_stream != steps_stream:
        backend.wait_event(steps_stream, backend.record_event(hooks_stream))


def _ready(final: set[int], params: list[tuple[int, torch.Tensor]]) -> bool:
    """Whether every parameter of a batch that the update will read is final: those that take a gradient in this
    backward have a final one, and none has a gradient it takes no more (frozen with its gradient kept: the backward
    may still read it, and it is final only after the backward)."""
    for _, param in params:
        if param.requires_grad:
            if id(param) not in final:
                return False
        elif param.grad is not None:
            return False
    return True


def _takes_gradients(param: torch.Tensor) -> bool:
    """Whether a backward can accumulate a gradient into ``param`` (a leaf that requires one): it gets a hook."""
    return param.requires_grad and param.is_leaf


def _gradient_final(this: weakref.ref[InBackward], param: torch.Tensor) -> None:
    step = this()
    newest = _HOOKED_BY.get(param)  # type: ignore[no-untyped-call]
    if step is not None and newest is not None and newest() is step:  # else a newer optimizer steps it in the backward
        step.gradient_final(param)
