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
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable
from typing import NoReturn

import torch
from torch.utils.hooks import RemovableHandle

from ..adapters.base import StateSwapAdapter, UpdateBatch
from ..errors import SwapStateError
from ..nesting import NestedFlag
from ..runtime.batch_walk import BatchWalk
from ..runtime.plan import SwapPlan
from ..stats import SwapStats
from ..trace import StepTrace
from ..user_warnings import warn_user
from .gradient_watch import GradientWatch
from .group_snapshot import GroupSnapshot
from .plan_cache import PlanCache
from .state_sync import StateSync
from .step_run import StepRun

__all__ = ["InBackwardStep", "check_in_backward_supported"]


def check_in_backward_supported(adapter: StateSwapAdapter, params: list[torch.Tensor]) -> None:
    """Refuse, before anything changes, what ``step="in_backward"`` does not support yet, naming the way out."""
    if adapter.partition_costs(params) is not None:
        raise ValueError(
            f"SwapConfig(step='in_backward') cannot run {type(adapter).__name__}: every rank walks all its batches "
            "together (a distributed family), so no batch can update on its own inside the backward; use "
            "step='after_backward'"
        )


@dataclasses.dataclass(frozen=True)
class _Started:
    """A step begun inside the backward: its run, its walk over the plan, and the adapter's step scope."""

    run: StepRun
    plan: SwapPlan
    walk: BatchWalk
    stats: SwapStats
    scope: contextlib.ExitStack
    groups: GroupSnapshot
    """The hyperparameters the batches updated with."""
    trace: StepTrace | None
    """With ``SwapConfig(trace=True)``: the step's timeline, timed from its first hook."""


class InBackwardStep:
    """The gradient hooks of ``SwapConfig(step="in_backward")`` and the step they begin (see the module)."""

    def __init__(self, owner: object, sync: StateSync, plans: PlanCache, update: Callable[[UpdateBatch], None]) -> None:
        """The hooks go when ``owner`` (the optimizer) is collected."""
        self._sync, self._plans, self._update = sync, plans, update
        self._final: set[int] = set()
        self._started: _Started | None = None
        self._accumulating = NestedFlag()
        self._hooks: list[RemovableHandle] = []
        self._hooked: set[int] = set()
        self._gave_up = False
        """No step can begin in this backward (tried at its first hook): the rest of it tries no more."""
        self._warned = False
        self._seen = GradientWatch()
        """The gradients of a backward in which no step began, as their hooks saw them."""
        self._repeated = False
        """A hook saw a gradient it had seen since the last ``step()`` (backwards accumulating outside
        :meth:`accumulating`)."""
        self.hook_params(sync.ordered_params())
        weakref.finalize(owner, InBackwardStep.remove_hooks, self)

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
    def started(self) -> bool:
        """Whether a step began inside the backward and awaits ``step()``."""
        return self._started is not None

    def gradient_final(self, param: torch.Tensor) -> None:
        """A gradient is final: update the batches it completes (begin the step at the first)."""
        if self._accumulating:
            return
        started = self._started
        if started is not None and started.run.applied(param):
            raise SwapStateError(
                f"A backward accumulated into the gradient of a parameter of shape {tuple(param.shape)} after its "
                "batch was updated with it (SwapConfig(step='in_backward')): run the backwards of the micro-batches "
                "before the last one inside `with opt.accumulating():`, or call step() after each backward"
            )
        self._final.add(id(param))
        if started is None:
            started = None if self._gave_up else self._begin()
            if started is None:
                self._gave_up = True
                if param.grad is not None:
                    self._repeated = self._repeated or param in self._seen  # a second backward since step()
                    self._seen.note(param, param.grad)  # step() refuses it edited, before anything changes
                return
        walk, scheduler = started.walk, self._sync.scheduler
        ordered = False
        with scheduler.working(), torch.no_grad():  # a backward with create_graph=True records its ops
            while (batch := walk.next_batch) is not None and self._ready(batch.params):
                if not ordered:
                    self._order_after_the_hooks_stream()
                    ordered = True
                try:
                    scheduler.advance_walk(started.plan, walk)
                except BaseException:
                    self._abandon()
                    raise
                started.stats.batches_in_backward += 1
                if self._sync.config.free_gradients:
                    started.run.free_gradients(batch, allocated_on=self._sync.backend.compute_stream())

    def finish(self) -> tuple[SwapStats, SwapPlan, StepTrace | None] | None:
        """``step()`` after a step began inside the backward: the batches left, then the check of the gradients
        used; ``None`` when no step began (``step()`` then runs as after a backward)."""
        started, self._started = self._started, None
        seen, self._seen = self._seen, GradientWatch()
        repeated, self._repeated = self._repeated, False
        self._final, self._gave_up = set(), False
        sync = self._sync
        if {id(param) for param in sync.ordered_params() if _takes_gradients(param)} != self._hooked:
            self.hook_params(sync.ordered_params())  # a group added, params replaced or unfrozen: hooks on them
        if started is None:
            if repeated:
                raise SwapStateError(
                    "Gradients were accumulated over several backwards before step() outside opt.accumulating(): "
                    "with SwapConfig(step='in_backward') the first backward would update the batches, before the "
                    "others added to their gradients. Refused now, before anything changed: run the backwards of "
                    "the micro-batches before the last one inside `with opt.accumulating():`, or use "
                    "step='after_backward'"
                )
            edited = seen.changed()
            if edited:
                raise SwapStateError(
                    f"{len(edited)} gradient(s) changed between the backward and step() (e.g. the first of shape "
                    f"{tuple(edited[0].shape)}): DDP's all-reduce, clip_grad_norm_, GradScaler or any edit of the "
                    "gradients after their post-accumulate-grad hooks ran. With SwapConfig(step='in_backward') the "
                    "batches update from those hooks, before such an edit, so it is refused now, before anything "
                    "changed. Edit gradients with step='after_backward'"
                )
            self._warn_of_stateless_params()
            return None
        changed = started.groups.changes(sync.param_groups)
        try:
            with started.groups.in_place(sync.param_groups):  # the rest of the step as it began
                keep_staging = sync.config.keep_staging
                sync.scheduler.end_walk(
                    started.plan, started.walk, started.stats, keep_staging=keep_staging, trace=started.trace
                )
            edited = started.run.edited_gradients()
        finally:
            started.scope.close()
            started.run.release()
        if changed:
            raise SwapStateError(
                f"{len(changed)} hyperparameter(s) changed between the backward that updated "
                f"{started.stats.batches_in_backward} batch(es) and step() ({changed[0]}): with "
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
        return started.stats, started.plan, started.trace

    def refuse_grad_scaler(self) -> NoReturn:
        """``GradScaler.step`` called this optimizer: raise, after ending a step that began inside the backward."""
        began = self._started is not None
        with contextlib.suppress(SwapStateError):  # GradScaler's inf check wrote the gradients; the step ends
            self.finish()
        raise SwapStateError(
            "GradScaler cannot drive SwapConfig(step='in_backward'): the batches update inside the backward, before "
            "GradScaler can unscale the gradients or skip a step whose gradients hold inf or NaN. "
            + (
                "This step's batches updated inside the backward with the scaled gradients. "
                if began
                else "Nothing was updated. "
            )
            + "Use step='after_backward' with GradScaler (bf16 autocast needs no scaler)"
        )

    def _warn_of_stateless_params(self) -> None:
        """Once: the steps run after the backward while some parameters have no state and get none now (they had no
        gradient yet)."""
        sync = self._sync
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
        state = self._sync.state
        return all(state.get(param) for param in self._sync.ordered_params() if param.requires_grad)

    def _order_after_the_hooks_stream(self) -> None:
        """Order the steps' stream after the stream this hook runs under, when they differ: FSDP2 runs the hooks
        under its post-reduce stream, where the reduce-scatter that wrote the gradient may still be running."""
        backend, steps_stream = self._sync.backend, self._sync.scheduler.compute
        hooks_stream = backend.compute_stream()
        if hooks_stream != steps_stream:
            backend.wait_event(steps_stream, backend.record_event(hooks_stream))

    def _ready(self, params: list[tuple[int, torch.Tensor]]) -> bool:
        final = self._final
        return all(id(param) in final for _, param in params if param.requires_grad)

    def _begin(self) -> _Started | None:
        """Begin the step over the current plan (after the user's edits), if it has batches and every parameter that
        requires a gradient has its state. With ``swap_times="auto"``, a plan whose staging runs out of device memory
        (nothing updated) is made again with twice the batches, once, as ``step()`` would."""
        try:
            return self._plan_and_start()
        except torch.OutOfMemoryError as error:
            auto = self._plans.auto
            if auto is None or not auto.more_batches_after(error, batches_updated=0):
                raise
        self._plans.drop()
        try:
            return self._plan_and_start()
        except torch.OutOfMemoryError as error:
            raise auto.still_out_of_memory(error, self._plans.last) from error

    def _plan_and_start(self) -> _Started | None:
        sync, plans = self._sync, self._plans
        with sync.scheduler.working():
            try:
                sync.follow_edits(sync.ordered_params())
                plan = plans.current()
            except torch.OutOfMemoryError:
                if plans.auto is not None:
                    raise
                return None  # step() raises it, after the backward, before any change
            except Exception:  # a refused edit or state: step() raises it, after the backward, before any change
                return None
            if not plan.batches or not (plan.all_states_exist or self._states_of_every_trained_param()):
                return None
        return self._start(plan)

    def _start(self, plan: SwapPlan) -> _Started:
        """The step over ``plan``, its first copy-in issued (an out-of-memory staging it leaves nothing begun)."""
        sync = self._sync
        scope, run = contextlib.ExitStack(), StepRun(sync, self._plans, self._update)
        try:
            # On the stream the steps run on, not the hook's (FSDP2's post-reduce stream): the staging belongs there.
            with sync.scheduler.working(), sync.backend.stream(sync.scheduler.compute):
                run.begin_in_backward()
                scope.enter_context(sync.adapter.step_scope())
                stats = SwapStats()
                if not sync.scheduler.prefetched:  # else opt.prefetch() started it: its copy-in is this step's first
                    sync.backend.start_transfer_window()
                trace = StepTrace() if sync.config.trace else None
                walk = sync.scheduler.begin_walk(plan, run.update_in_backward, stats, traced=trace is not None)
        except BaseException:
            scope.close()
            run.release()
            raise
        self._started = _Started(run, plan, walk, stats, scope, GroupSnapshot(sync.param_groups), trace)
        return self._started

    def _abandon(self) -> None:
        """A batch failed inside the backward: the step ends there (the pipeline made the host mirrors current)."""
        started, self._started = self._started, None
        self._final = set()
        if started is not None:
            started.scope.close()
            started.run.release()


def _takes_gradients(param: torch.Tensor) -> bool:
    """Whether a backward can accumulate a gradient into ``param`` (a leaf that requires one): it gets a hook."""
    return param.requires_grad and param.is_leaf


def _gradient_final(this: weakref.ref[InBackwardStep], param: torch.Tensor) -> None:
    step = this()
    if step is not None:
        step.gradient_final(param)
