"""``SwapConfig(step="in_backward")``: each batch updates inside the backward, as soon as its gradients are final.

The contract, in one place:

- A post-accumulate-grad hook on every parameter marks its gradient final. The plan walks its batches in the order
  a backward finalizes gradients (the last parameters first); when every parameter of the walk's next batch that
  takes a gradient has a final one, the batch is copied in (the one after it too), updated and copied out, inside
  the hook, on the stream the step began on. The rest of the backward runs meanwhile.
- ``step()`` updates the batches still left (a parameter that got no gradient is skipped, as torch skips it), ends
  the step as a plain ``step()`` would (step counters, stats, the LR schedulers' bookkeeping), and then checks every
  gradient a batch used: one replaced or written in place since (``clip_grad_norm_`` or ``GradScaler.unscale_``
  after the backward) raises :class:`~swap_core.errors.SwapStateError` naming it. The update it made cannot be taken
  back: edit gradients only with ``step="after_backward"``.
- Gradient accumulation: the backwards of the micro-batches before the last run inside ``opt.accumulating()``, where
  the hooks update nothing. A backward outside it that reaches a gradient whose batch already updated raises from
  the hook (the backward stops there).
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
from typing import NoReturn

import torch
from torch.utils.hooks import RemovableHandle

from ...adapters.base import StateSwapAdapter
from ...errors import SwapStateError
from ...nesting import NestedFlag
from ...runtime.batch_walk import BatchWalk
from ...stats import SwapStats
from ...trace import StepTrace
from ...user_warnings import warn_user
from ..plan_cache import PlanCache
from ..setup import SwapSetup
from ..state_sync import StateSync
from ..step_driver import StepDriver, StepOutcome
from .gradient_watch import GradientWatch
from .group_snapshot import GroupSnapshot
from .run import InBackwardRun

__all__ = ["InBackward"]


@dataclasses.dataclass(frozen=True)
class _Started:
    """A step begun inside the backward: its run, its walk, the adapter's step scope and what it began with."""

    run: InBackwardRun
    walk: BatchWalk
    stats: SwapStats
    scope: contextlib.ExitStack
    groups: GroupSnapshot
    """The hyperparameters the batches updated with."""
    trace: StepTrace | None
    """With ``SwapConfig(trace=True)``: the step's timeline, timed from its first hook."""

    def close(self) -> None:
        self.scope.close()
        self.run.release()


@dataclasses.dataclass
class _SinceStep:
    """What the backwards since the last ``step()`` did (replaced at every ``step()``)."""

    final: set[int] = dataclasses.field(default_factory=set)
    """The parameters whose gradient is final in this backward."""
    started: _Started | None = None
    cannot_begin: bool = False
    """No step can begin in this backward (found at its first hook): the rest of it tries no more."""
    seen: GradientWatch = dataclasses.field(default_factory=GradientWatch)
    """The gradients of a backward in which no step began, as their hooks saw them."""
    repeated: bool = False
    """A hook saw a gradient it had seen since the last ``step()`` (backwards accumulating outside
    :meth:`InBackward.accumulating`)."""


class InBackward(StepDriver):
    """The step driver of ``SwapConfig(step="in_backward")``: the gradient hooks and the step they begin (see the
    module)."""

    claims_amp_scaling = True
    """``GradScaler`` is refused at ``step()``: the batches updated before it could unscale or skip."""
    updates_resident_first = False
    """Every parameter updates with its batch, once its gradient is final."""
    walks_in_backward_order = True
    """The batches are walked in the order a backward finalizes gradients (the last parameters first)."""

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
        self._hooks: list[RemovableHandle] = []
        self._hooked: set[int] = set()
        self._warned = False
        self.hook_params(sync.ordered_params())
        weakref.finalize(owner, InBackward.remove_hooks, self)

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
                self._hooks.append(hook)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

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
        if now.started is not None and now.started.run.applied(param):
            raise SwapStateError(
                f"A backward accumulated into the gradient of a parameter of shape {tuple(param.shape)} after its "
                "batch was updated with it (SwapConfig(step='in_backward')): run the backwards of the micro-batches "
                "before the last one inside `with opt.accumulating():`, or call step() after each backward"
            )
        now.final.add(id(param))
        with self.setup.scheduler.working(), torch.no_grad():  # a backward with create_graph=True records its ops
            for retried in (False, True):
                try:
                    started = now.started or (None if now.cannot_begin else self._begin(now))
                    if started is None:
                        self._note_unstepped(now, param)
                        return
                    self._update_ready_batches(now, started)
                    return
                except BaseException as error:
                    begun = now.started.run.updates_begun if now.started is not None else 0
                    self._abandon(now)
                    if not self.plans.retry_after(error, updates_begun=begun, retried=retried):
                        now.final = set()
                        raise

    def _update_ready_batches(self, now: _SinceStep, started: _Started) -> None:
        walk, scheduler, free = started.walk, self.setup.scheduler, self.setup.free_gradients
        ordered = False
        while (batch := walk.next_batch) is not None and _ready(now.final, batch.params):
            if not ordered:
                self._order_after_the_hooks_stream()
                ordered = True
            scheduler.advance(walk)
            started.stats.batches_in_backward += 1
            if free:
                started.run.free_gradients(batch, allocated_on=self.setup.backend.compute_stream())

    def _note_unstepped(self, now: _SinceStep, param: torch.Tensor) -> None:
        """No step began in this backward: the gradient is noted, so that ``step()`` refuses it edited (or
        accumulated over several backwards) before anything changes."""
        if param.grad is not None:
            now.repeated = now.repeated or param in now.seen  # a second backward since step()
            now.seen.note(param, param.grad)

    def _begin(self, now: _SinceStep) -> _Started | None:
        """Plan the step over the state as it is now (after the user's edits) and begin its walk, if the plan has
        batches and every parameter that requires a gradient has its state; else ``None`` for the rest of this
        backward (``step()`` runs the step after it, and raises what planning refused, before any change)."""
        run = InBackwardRun(self.setup, self.sync, self.plans)
        try:
            plan = run.prepare()
        except torch.OutOfMemoryError:
            if self.setup.batch_count.replans_after_out_of_memory:
                raise  # re-planned with more batches, once
            plan = None
        except Exception:  # a refused edit or state
            plan = None
        if plan is None or not plan.batches or not (plan.all_states_exist or self._states_of_every_trained_param()):
            run.release()
            now.cannot_begin = True
            return None
        setup = self.setup
        scope = contextlib.ExitStack()
        try:
            # On the stream the steps run on, not the hook's (FSDP2's post-reduce stream): the staging belongs there.
            with setup.backend.stream(setup.scheduler.compute):
                scope.enter_context(setup.adapter.step_scope())
                stats, trace = SwapStats(), setup.new_trace()
                if not setup.scheduler.prefetched:  # else opt.prefetch() started it: its copy-in is this step's first
                    setup.backend.start_transfer_window()
                walk = setup.scheduler.begin(plan, run.update, stats, traced=trace is not None)
        except BaseException:
            scope.close()
            run.release()
            raise
        now.started = _Started(run, walk, stats, scope, GroupSnapshot(self.sync.param_groups), trace)
        return now.started

    def _abandon(self, now: _SinceStep) -> None:
        """A batch, or the beginning, failed inside the backward: the step ends there (the pipeline made the host
        mirrors current)."""
        started, now.started = now.started, None
        if started is not None:
            started.close()

    # -- step() ---------------------------------------------------------------------------
    def step(self) -> StepOutcome:
        """``step()`` after a step began inside the backward: the batches left, then the checks of the gradients and
        hyperparameters the batches used; the step after the backward when none began."""
        now, self._now = self._now, _SinceStep()
        with self.setup.scheduler.working():  # reads of the state here wait for nothing
            self._hook_new_params()
            if now.started is None:
                _refuse_edits_since_the_backward(now)
                self._warn_of_stateless_params()
                return super().step()
            outcome, changed, edited = self._end(now.started)
        if changed:
            raise SwapStateError(
                f"{len(changed)} hyperparameter(s) changed between the backward that updated "
                f"{outcome.stats.batches_in_backward} batch(es) and step() ({changed[0]}): with "
                "SwapConfig(step='in_backward') those batches used the values the backward began with, and so did "
                "the rest of this step; the new values apply from the next step. Change them after step() (step "
                "LR schedulers after opt.step(); no step pre-hook that sets them), or use step='after_backward'"
            )
        if edited:
            raise SwapStateError(
                f"{len(edited)} gradient(s) changed after their batch updated inside the backward (e.g. the first "
                f"of shape {tuple(edited[0].shape)}): clip_grad_norm_, GradScaler or any edit of the gradients "
                "between backward() and step() comes too late with SwapConfig(step='in_backward'), and those "
                "updates used the gradients as the backward left them. Edit gradients with step='after_backward'"
            )
        return outcome

    def _end(self, started: _Started) -> tuple[StepOutcome, list[str], list[torch.Tensor]]:
        """The rest of the step begun inside the backward, as it began; its outcome, the hyperparameters changed
        since it began and the gradients edited since their batch used them."""
        groups = self.sync.param_groups
        changed = started.groups.changes(groups)
        try:
            with started.groups.in_place(groups):
                self.setup.scheduler.end(started.walk, trace=started.trace)
            edited = started.run.edited_gradients()
            started.run.finish()
        finally:
            started.close()
        return self.finished(StepOutcome(started.stats, started.trace, started.walk.plan)), changed, edited

    def refuse_amp_scaling(self) -> NoReturn:
        """``GradScaler.step`` called this optimizer: raise, after ending a step that began inside the backward."""
        started, self._now = self._now.started, _SinceStep()
        if started is not None:  # GradScaler's inf check wrote the gradients; the step ends as it began
            with self.setup.scheduler.working():
                self._end(started)
        raise SwapStateError(
            "GradScaler cannot drive SwapConfig(step='in_backward'): the batches update inside the backward, before "
            "GradScaler can unscale the gradients or skip a step whose gradients hold inf or NaN. "
            + (
                "This step's batches updated inside the backward with the scaled gradients. "
                if started is not None
                else "Nothing was updated. "
            )
            + "Use step='after_backward' with GradScaler (bf16 autocast needs no scaler)"
        )

    def _hook_new_params(self) -> None:
        """A group added, params replaced or unfrozen: hooks on them."""
        params = self.sync.ordered_params()
        if {id(param) for param in params if _takes_gradients(param)} != self._hooked:
            self.hook_params(params)

    def _warn_of_stateless_params(self) -> None:
        """Once: the steps run after the backward while some parameters have no state and get none now (they had no
        gradient yet)."""
        sync = self.sync
        if self._warned or not sync.state:
            return
        stateless = [
            param
            for param in sync.ordered_params()
            if param.requires_grad and param.grad is None and not sync.state.get(param)  # with a gradient: one now
        ]
        if stateless:
            self._warned = True
            warn_user(
                f"SwapConfig(step='in_backward'): {len(stateless)} parameter(s) have no optimizer state yet (they "
                f"never had a gradient; the first of shape {tuple(stateless[0].shape)}), so the steps run after the "
                "backward until every parameter has one; parameters that never take a gradient should not require "
                "one (requires_grad_(False)) or be left out of the optimizer",
                UserWarning,
            )

    def _states_of_every_trained_param(self) -> bool:
        """Whether every parameter that requires a gradient has its state (frozen ones never get one)."""
        state = self.sync.state
        return all(state.get(param) for param in self.sync.ordered_params() if param.requires_grad)

    def _order_after_the_hooks_stream(self) -> None:
        """Order the steps' stream after the stream this hook runs under, when they differ: FSDP2 runs the hooks
        under its post-reduce stream, where the reduce-scatter that wrote the gradient may still be running."""
        backend, steps_stream = self.setup.backend, self.setup.scheduler.compute
        hooks_stream = backend.compute_stream()
        if hooks_stream != steps_stream:
            backend.wait_event(steps_stream, backend.record_event(hooks_stream))


def _refuse_edits_since_the_backward(now: _SinceStep) -> None:
    """``step()`` after backwards in which no step began: refuse, before anything changes, gradients accumulated over
    several backwards outside ``opt.accumulating()`` or edited after their hooks ran."""
    if now.repeated:
        raise SwapStateError(
            "Gradients were accumulated over several backwards before step() outside opt.accumulating(): "
            "with SwapConfig(step='in_backward') the first backward would update the batches, before the "
            "others added to their gradients. Refused now, before anything changed: run the backwards of "
            "the micro-batches before the last one inside `with opt.accumulating():`, or use "
            "step='after_backward'"
        )
    edited = now.seen.changed()
    if edited:
        raise SwapStateError(
            f"{len(edited)} gradient(s) changed between the backward and step() (e.g. the first of shape "
            f"{tuple(edited[0].shape)}): DDP's all-reduce, clip_grad_norm_, GradScaler or any edit of the "
            "gradients after their post-accumulate-grad hooks ran. With SwapConfig(step='in_backward') the "
            "batches update from those hooks, before such an edit, so it is refused now, before anything "
            "changed. Edit gradients with step='after_backward'"
        )


def _ready(final: set[int], params: list[tuple[int, torch.Tensor]]) -> bool:
    return all(id(param) in final for _, param in params if param.requires_grad)


def _takes_gradients(param: torch.Tensor) -> bool:
    """Whether a backward can accumulate a gradient into ``param`` (a leaf that requires one): it gets a hook."""
    return param.requires_grad and param.is_leaf


def _gradient_final(this: weakref.ref[InBackward], param: torch.Tensor) -> None:
    step = this()
    if step is not None:
        step.gradient_final(param)
