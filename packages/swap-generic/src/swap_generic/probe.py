"""A wrap-time check that an optimizer's step is per-parameter, on tiny stand-in parameters.

swap-generic runs the optimizer's step batch by batch, which is exact only if each parameter's update reads its
own gradient and state alone. An optimizer that couples parameters would be silently wrong batch by batch, or would
fail part-way through a step, after earlier batches were updated. :func:`probe_step` steps twins of the optimizer
(deep copies that share nothing mutable with it, :mod:`swap_generic.sandbox`: param groups of their own over two
small stand-ins per group, states of their own) once together and once one stand-in at a time, as the real step runs
its batches, and compares everything the two leave behind bitwise. It does so for inputs that make a whole-step
decision visible:

- ordinary gradients (a coupling of the update itself: a shared norm, a group-wide statistic);
- large gradients (clipping by a global norm inside the step, which small gradients never trip);
- a non-finite gradient in one stand-in (a step that skips itself when any gradient is not finite).

And it looks at what the step leaves: a state held in a Python object (a list, a dict, a projector), entries of
``optimizer.state`` that belong to no parameter (a step counter), param group values written per call, edits of the
param groups. Each twin steps under a forked RNG seeded alike, so an optimizer that draws its initial states at random
is compared with itself, and the caller's RNG is left as it was; the generators its steps advanced are named
(:attr:`ProbeVerdict.draws_random`): swapped, such a step must update the parameters in torch's order.

A step that runs autograd on the gradients (Hessian-vector products: the gradients must carry their graph, as after
``loss.backward(create_graph=True)``) fails on plain gradients: the probe then gives the stand-ins gradients with a
graph of their own, one graph over both stand-ins with a term coupling them, as a loss over the real parameters is.
Run one stand-in at a time, such a step fails at its second batch (the first freed the graph) or reads a Hessian
without its cross terms: either way it is not per-parameter.

What it cannot see: a coupling that only shows on inputs it does not try, or only after more than
:data:`PROBE_STEPS` steps; a step that needs the closure. When it cannot step the twins at all, it cannot tell:
:attr:`ProbeVerdict.unknown` says why, and the adapter refuses unless the optimizer declares itself
(``swap_per_parameter``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from swap_core.adapters import GroupValues, NarrowedGroups, same_value
from swap_core.errors import UnsupportedOptimizerError
from swap_core.torch_compat import step_hooks_silenced

from .delegation import held_parameter, inner_optimizer
from .first_parameter_values import FirstParameterValues
from .nested_states import flat_state, is_nest, nest_clash, nest_problem
from .random_draws import DrawWatch
from .sandbox import Sandbox
from .third_party import outside_step_methods
from .torch_compat import unhooked_step

__all__ = ["PROBE_STEPS", "ProbeVerdict", "probe_step"]

PROBE_STEPS = 3
"""Steps each pair of stand-ins takes (momentum-like couplings need more than one)."""

_SEED = 1234
_STANDIN_SIZES = ((4, 3, 2, 2, 2), (3, 5, 2, 2, 2))
"""The sizes of the two stand-ins of each layout (the first ``dim`` of them)."""
_LARGE = 1e4
"""The large gradients' scale: a global norm of the stand-ins' gradients far above any clipping threshold."""

_CROSS = 0.125
"""The weight of the term that couples the stand-ins in the loss behind gradients that carry a graph."""

_PLAIN_VALUES = (int, float, bool, complex, str, type(None))


@dataclasses.dataclass(frozen=True)
class ProbeVerdict:
    """What stepping the stand-ins told."""

    coupled: str | None = None
    """Why the step is not per-parameter (refused), or ``None``."""
    container: str | None = None
    """A state the step keeps in a Python object (refused whatever the optimizer declares), or ``None``."""
    unknown: str | None = None
    """Why the twins could not be stepped, so that nothing could be told, or ``None``."""
    no_step: str | None = None
    """Why the optimizer has no step to run (it raises ``NotImplementedError``: other methods drive it, such as a
    fused backward), or ``None``. Refused whatever the optimizer declares."""
    fails_apart: str | None = None
    """Why the step fails when run one batch at a time where it runs whole (refused whatever the optimizer declares:
    no declaration makes a later batch not raise), or ``None``."""
    delegates: str | None = None
    """Why the step is another optimizer's (an inner optimizer reachable from the optimizer's attributes, named by
    its path), found before any twin is made: such an optimizer is never stepped, and refused whatever it declares;
    or ``None``."""
    holds_parameter: str | None = None
    """Where the optimizer holds one of its own parameters outside its param groups (a dict pairing LoRA's A and B
    by identity), which the stand-ins cannot take the place of: a step that reads a partner through it was not
    checked. Refused unless the optimizer declares itself; or ``None``."""
    state_keys: frozenset[str] = frozenset()
    """The keys of the stand-ins' states: what the optimizer creates for a parameter (when the twins stepped), each
    value of a nested dict as a key of its own (``"moments.exp_avg"``, :mod:`swap_generic.nested_states`)."""
    nests: frozenset[str] = frozenset()
    """The keys of the stand-ins' states that hold a nested dict of tensors and numbers (``"moments"``)."""
    param_shaped_keys: frozenset[str] = frozenset()
    """Those of :attr:`state_keys` whose state was, for every stand-in, a tensor of its shape and dtype: what a
    parameter's first step creates in the parameter's own shape (other keys, a factored moment, have other sizes)."""
    later_keys: frozenset[str] = frozenset()
    """Keys the step added to a stand-in's state, or removed from it, after the step that created the state (an
    SWA-style average begun at the second step): a parameter's state may lack them, or hold them, as the optimizer
    goes."""
    first_parameter_keys: frozenset[str] = frozenset()
    """Keys the step keeps only in the state of its group's first parameter and reads for the whole group (a step
    count): the stand-ins stepped one at a time, with those values lent to each (:mod:`.first_parameter_values`), left
    everything as stepped together."""
    draws_random: str | None = None
    """The generators the step drew random numbers from over the stand-ins (noise added in the step, a state
    initialised from the RNG), named (:mod:`swap_generic.random_draws`); or ``None``. Each draw lands on the
    parameter torch's step gives it only when the parameters update in torch's order."""


GradientOf = Callable[[int, int, tuple[int, ...], torch.Generator], torch.Tensor]
"""``(step, stand-in, shape, generator) -> gradient`` of one input of the probe."""


def _ordinary(step: int, position: int, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator)


def _large(step: int, position: int, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator) * _LARGE


def _one_not_finite(step: int, position: int, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    grad = torch.randn(shape, generator=generator)
    if step == 1 and position == len(_STANDIN_SIZES) - 1:  # the last: run apart, the stand-in before it updates
        grad.view(-1)[0] = float("inf")
    return grad


INPUTS: dict[str, GradientOf] = {
    "ordinary gradients": _ordinary,
    "large gradients": _large,
    "a non-finite gradient in one parameter": _one_not_finite,
}
"""The inputs the probe steps the stand-ins with, by what they are."""


def probe_step(optimizer: torch.optim.Optimizer) -> ProbeVerdict:
    """Step twins of ``optimizer`` together and apart over stand-ins of each param group; nothing of ``optimizer``
    (nor the global RNG) changes."""
    inner = inner_optimizer(optimizer)
    if inner is not None:
        return ProbeVerdict(
            delegates=f"its step delegates to another optimizer ({type(inner.optimizer).__name__} at {inner.path})"
        )
    keys: set[str] = set()
    nests: set[str] = set()
    later: set[str] = set()
    first: set[str] = set()
    draws: dict[str, None] = {}
    shaped: set[str] | None = None
    sandbox = Sandbox(optimizer)
    for index, group in enumerate(optimizer.param_groups):
        for like in _distinct_layouts(group["params"]):
            with_graph = False
            for name, gradient_of in INPUTS.items():
                outcome = _compare(sandbox, index, like, gradient_of, with_graph=with_graph)
                if isinstance(outcome, _Unknown) and not with_graph:
                    # A step that runs autograd on the gradients needs them to carry a graph: try such gradients.
                    retried = _compare(sandbox, index, like, gradient_of, with_graph=True)
                    if not isinstance(retried, _Unknown):
                        outcome, with_graph = retried, True
                if not isinstance(outcome, _Keys):
                    return _refusal(outcome, group, index, like, _named(name, with_graph), with_graph=with_graph)
                keys |= outcome.keys
                nests |= outcome.nests
                later |= outcome.later
                first |= outcome.first
                draws.update(dict.fromkeys(outcome.draws or ()))
                shaped = outcome.param_shaped if shaped is None else shaped & outcome.param_shaped
    return ProbeVerdict(
        holds_parameter=_held(optimizer),
        state_keys=frozenset(keys),
        nests=frozenset(nests),
        param_shaped_keys=frozenset(shaped or ()),
        later_keys=frozenset(later),
        first_parameter_keys=frozenset(first),
        draws_random=" and ".join(draws) or None,
    )


def _refusal(
    outcome: _Unknown | _Container | _FailsApart | _FirstParameterState | str,
    group: dict[str, Any],
    index: int,
    like: torch.Tensor,
    inputs: str,
    *,
    with_graph: bool,
) -> ProbeVerdict:
    """The verdict of an ``outcome`` that refuses, naming what blocked: the key, the param group and the parameter
    (``like``, the one whose layout the stand-ins took), or the inputs that showed it; autograd only where the
    gradients carried a graph."""
    if isinstance(outcome, _Unknown):
        return ProbeVerdict(no_step=outcome.reason) if outcome.not_implemented else ProbeVerdict(unknown=outcome.reason)
    if isinstance(outcome, _FirstParameterState):
        first = group["params"][0]
        return ProbeVerdict(
            coupled=f"it keeps {outcome.key!r} only in the state of its group's first parameter (param group {index}'s "
            f"parameter 0, shape {tuple(first.shape)}), where the step reads it for every parameter of the group "
            "(stepped together, only the first stand-in's state held it), and it is not a value of the group: lent to "
            "the first stand-in of each batch as the group's first parameter held it when the step began, stepping "
            f"them one at a time {outcome.why} ({inputs}). Keep it in the param group (group[{outcome.key!r}]) or in "
            "every parameter's state"
        )
    if isinstance(outcome, _Container):
        position = next(position for position, param in enumerate(group["params"]) if param is like)
        return ProbeVerdict(
            container=f"{outcome.reason} (param group {index}'s parameter {position}, shape {tuple(like.shape)}, "
            f"and every parameter of {like.dim()} dimensions in it): {outcome.fix}"
        )
    if isinstance(outcome, _FailsApart):
        cause = " (a step that runs autograd through the gradients' graph frees it in the first batch)"
        return ProbeVerdict(
            fails_apart=f"{outcome.reason} (param group {index}, {inputs}){cause if with_graph else ''}"
        )
    return ProbeVerdict(coupled=f"{outcome} (param group {index}, {inputs})")


def _held(optimizer: torch.optim.Optimizer) -> str | None:
    held = held_parameter(optimizer)
    if held is None:
        return None
    where = f"parameter {held.position} of param group {held.group_index}, shape {held.shape}"
    return f"it holds one of its parameters outside its param groups ({where}, at {held.path})"


def _named(name: str, with_graph: bool) -> str:
    return f"{name} carrying their graph" if with_graph else name


@dataclasses.dataclass(frozen=True)
class _Unknown:
    reason: str
    not_implemented: bool = False
    """The step raised ``NotImplementedError``: the optimizer is driven by other methods."""


@dataclasses.dataclass(frozen=True)
class _FailsApart:
    reason: str


@dataclasses.dataclass(frozen=True)
class _Container:
    reason: str
    fix: str


@dataclasses.dataclass(frozen=True)
class _FirstParameterState:
    key: str
    """A key only the first stand-in's state holds stepped together, and a later one's too stepped alone."""
    why: str
    """What stepping the stand-ins one at a time, with such keys lent, did otherwise than stepping them together."""


@dataclasses.dataclass(frozen=True)
class _Keys:
    keys: set[str]
    nests: set[str]
    param_shaped: set[str]
    later: set[str]
    first: set[str]
    draws: tuple[str, ...] = ()
    """The generators the twins' steps drew from."""


def _distinct_layouts(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """One floating parameter per number of dimensions (states may differ by it: Adafactor's factored moments)."""
    seen: dict[int, torch.Tensor] = {}
    for param in params:
        if param.is_floating_point() and param.dim() not in seen:
            seen[param.dim()] = param
    return list(seen.values())


def _compare(
    sandbox: Sandbox, index: int, like: torch.Tensor, gradient_of: GradientOf, *, with_graph: bool
) -> _Unknown | _Container | _FailsApart | _FirstParameterState | str | _Keys:
    """Stepped together and apart: their difference (``str``), that the step fails apart only, that they could not
    be stepped, a state held in a Python object, or (all alike) the state keys.

    The twins are deep copies of the optimizer (:mod:`swap_generic.sandbox`); where such a twin cannot step (a
    constructor that makes states: Adagrad's ``sum``), twins built by the optimizer's own constructor are tried.
    """
    failed: _Unknown | None = None
    for constructed in (False, True):
        twins = functools.partial(
            _stepped, sandbox, index, like, gradient_of, constructed=constructed, with_graph=with_graph
        )
        together = twins(apart=False)
        if isinstance(together, _Unknown):
            failed = failed or together  # the copied twin's failure says more than the constructor's
            continue
        apart = twins(apart=True)
        if isinstance(apart, _Unknown):
            return f"stepping the stand-ins one at a time failed where stepping them together did not ({apart.reason})"
        first_only = together.first_parameter_keys(apart)
        if first_only:  # a value of the group kept in its first parameter's state: lent to each batch's first one
            apart = twins(apart=True, lent_keys=frozenset(first_only))
            why = _lending_difference(together, apart)
            if why is not None:
                return _FirstParameterState(first_only[0], why)
            assert not isinstance(apart, _Unknown)
        if apart.failure is not None and together.failure is None:
            return _FailsApart(
                f"stepping the stand-ins one at a time failed where stepping them together did not ({apart.failure})"
            )
        difference = together.difference(apart)
        if difference is not None:
            return f"stepping two stand-in parameters together and one at a time {difference}"
        container = together.container_state()
        if container is not None:
            return container
        drawn = () if together.draws is None else (together.draws,)
        keys = together.state_keys()
        first = set(first_only)
        return _Keys(keys, together.nests, together.param_shaped_keys(), together.later_keys(), first, drawn)
    assert failed is not None
    return failed


@dataclasses.dataclass
class _Outcome:
    """What a twin holds after its probe steps."""

    params: list[torch.Tensor]
    states: list[dict[str, Any]]
    """Each stand-in's state, nested dicts of tensors and numbers flattened (:func:`~.nested_states.flat_state`)."""
    others: dict[str, Any]
    """Entries of ``state`` that belong to no stand-in (by ``repr`` of their keys)."""
    groups: list[dict[str, Any]]
    failure: str | None
    """The type and message of an exception a step raised (both runs must fail alike)."""
    first_keys: list[set[str]] = dataclasses.field(default_factory=list)
    """The keys of each stand-in's state after the first step (empty when it did not finish)."""
    draws: str | None = None
    """The generators the twin's steps drew from (:class:`~swap_generic.random_draws.DrawWatch`), or ``None``."""
    nests: set[str] = dataclasses.field(default_factory=set)
    """The keys of the stand-ins' states that held nested dicts of tensors and numbers."""
    clash: str | None = None
    """Why a state's flat form could not be told from its nests (:func:`~.nested_states.nest_clash`), or ``None``."""

    @classmethod
    def left_by(
        cls, twin: torch.optim.Optimizer, steps: _ProbeSteps, failure: str | None, watch: DrawWatch
    ) -> _Outcome:
        """What ``twin`` holds over the stand-ins of ``steps`` now (its param groups without their params), and the
        generators ``watch`` saw its steps draw from."""
        standins = steps.standins
        states = [twin.state.get(standin, {}) for standin in standins]
        return cls(
            params=[standin.detach() for standin in standins],
            states=[flat_state(state) for state in states],
            others={repr(key): value for key, value in twin.state.items() if not any(key is s for s in standins)},
            groups=[{key: value for key, value in group.items() if key != "params"} for group in twin.param_groups],
            failure=failure,
            first_keys=steps.first_keys,
            draws=watch.drawn(),
            nests={key for state in states for key, value in state.items() if is_nest(value)},
            clash=next(filter(None, map(nest_clash, states)), None),
        )

    def difference(self, other: _Outcome) -> str | None:
        if self.failure != other.failure:
            return f"failed differently ({self.failure or 'no error'} against {other.failure or 'no error'})"
        when = f"after {PROBE_STEPS} steps" if self.failure is None else f"both failing with {self.failure}"
        for position, (param, other_param) in enumerate(zip(self.params, other.params, strict=True)):
            if not _same_bits(param, other_param):
                return f"gave different values (stand-in {position}, {when})"
        return self._state_difference(other) or self._group_difference(other)

    def _state_difference(self, other: _Outcome) -> str | None:
        for position, (state, other_state) in enumerate(zip(self.states, other.states, strict=True)):
            if set(state) != set(other_state):
                return f"gave stand-in {position} other state keys ({sorted(state)} against {sorted(other_state)})"
            for key, value in state.items():
                if not _same_state(value, other_state[key]):
                    return f"gave stand-in {position} another state {key!r}"
        if set(self.others) != set(other.others) or not all(
            _same_state(value, other.others[key]) for key, value in self.others.items()
        ):
            return f"left other entries of optimizer.state that belong to no parameter ({sorted(self.others)})"
        return None

    def _group_difference(self, other: _Outcome) -> str | None:
        for index, (group, other_group) in enumerate(zip(self.groups, other.groups, strict=True)):
            for key in sorted(set(group) | set(other_group), key=str):
                if not same_value(group.get(key), other_group.get(key)):
                    whole, alone = group.get(key), other_group.get(key)
                    return (
                        f"wrote param group {index}'s {key!r} differently ({whole!r} against {alone!r}): the step "
                        f"writes it from the parameters it is given ({whole!r} for two stand-in parameters stepped "
                        f"together, {alone!r} for each alone), so each batch would write its own share's value where "
                        "torch's step writes the whole group's"
                    )
        return None

    def container_state(self) -> _Container | None:
        if self.clash is not None:
            return _Container(self.clash, "rename the key, or write a dedicated adapter")
        for state in self.states:
            for key, value in state.items():
                if isinstance(value, dict):  # a nested dict of tensors and numbers is flat here: not such a one
                    return _Container(
                        nest_problem(key, value),
                        "swap-generic moves the tensors of a dict nested one level deep (string keys, tensors and "
                        "numbers) and keeps numbers, but cannot tell where the tensors of other dicts live. Keep them "
                        "in such a dict, or as keys of the state, or write a dedicated adapter",
                    )
                if not isinstance(value, (torch.Tensor, *_PLAIN_VALUES)):
                    return _Container(
                        f"it keeps state {key!r} as a {type(value).__name__}",
                        "swap-generic moves tensor states and keeps numbers, but cannot tell where the tensors inside "
                        "other objects live. Write a dedicated adapter",
                    )
        return None

    def first_parameter_keys(self, apart: _Outcome) -> list[str]:
        """Keys that, stepped together, only the first stand-in's state holds, and that a later stand-in's holds too
        stepped alone (or whose step then failed): a value of the group kept in its first parameter's state."""
        if len(self.states) < 2 or len(apart.states) != len(self.states) or self.failure is not None:
            return []
        only_first = set(self.states[0]).difference(*self.states[1:])
        later_apart = [key for state in apart.states[1:] for key in state]
        return sorted(key for key in only_first if apart.failure is not None or key in later_apart)

    def state_keys(self) -> set[str]:
        return {key for state in self.states for key in state}

    def later_keys(self) -> set[str]:
        """Keys a stand-in's state gained or lost after its first step (none known when the first step failed)."""
        if len(self.first_keys) != len(self.states):
            return set()
        pairs = zip(self.first_keys, self.states, strict=True)
        return {key for first, state in pairs if first for key in first ^ set(state)}

    def param_shaped_keys(self) -> set[str]:
        """Keys whose state is a tensor of its stand-in's shape and dtype, for every stand-in."""
        shaped: set[str] | None = None
        for param, state in zip(self.params, self.states, strict=True):
            here = {
                key
                for key, value in state.items()
                if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dtype == param.dtype
            }
            shaped = here if shaped is None else shaped & here
        return shaped or set()


def _stepped(
    sandbox: Sandbox,
    index: int,
    like: torch.Tensor,
    gradient_of: GradientOf,
    *,
    apart: bool,
    constructed: bool,
    with_graph: bool = False,
    lent_keys: frozenset[str] = frozenset(),
) -> _Outcome | _Unknown:
    """A twin of the sandbox's optimizer over two stand-ins of group ``index``, after :data:`PROBE_STEPS` steps
    (``with_graph``: their gradients carry a graph, see :func:`_with_graph`).

    Whatever the twin's code raises on the planted inputs is an outcome, ``SystemExit`` included (a step that ends
    the program on a non-finite gradient must not end it at wrap time); a ``KeyboardInterrupt`` goes through, the
    global RNG and grad mode restored on its way.
    """
    generator = torch.Generator().manual_seed(_SEED)
    # Meta tensors hold no values to compare (swap-bench's planner steps them): the stand-ins live on the CPU.
    device = torch.device("cpu") if like.is_meta else like.device
    standins = _standins(like.dim(), device, generator)
    steps = _ProbeSteps(
        index, standins, gradient_of, generator, apart=apart, with_graph=with_graph, lent_keys=lent_keys
    )
    with _seeded_rng(device):
        twin = sandbox.twin(index, standins, constructed=constructed)
        if twin is None:
            return _Unknown(
                f"{type(sandbox.optimizer).__name__}'s constructor could not rebuild it over stand-in parameters"
            )
        watch = DrawWatch(twin, device)
        try:
            steps.run(twin)
        except UnsupportedOptimizerError as refusal:  # the batch-by-batch runner's own refusal: not per-parameter
            return _Outcome([], [], {}, [], f"{type(refusal).__name__}: {refusal}")
        except NotImplementedError as error:  # driven outside step() (a fused backward): nothing to batch
            return _Unknown(f"its step() is not implemented ({error})", not_implemented=True)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # SystemExit too: code run on planted inputs cannot end the program
            if not apart and steps.taken == 0:
                return _Unknown(f"its step failed on stand-in parameters: {type(error).__name__}: {error}")
            return _Outcome.left_by(twin, steps, f"{type(error).__name__}: {error}", watch)
        return _Outcome.left_by(twin, steps, None, watch)


@dataclasses.dataclass
class _ProbeSteps:
    """The :data:`PROBE_STEPS` steps of one twin over its stand-ins, whole or one stand-in at a time (``apart``)."""

    index: int
    standins: list[torch.Tensor]
    gradient_of: GradientOf
    generator: torch.Generator
    apart: bool
    with_graph: bool
    lent_keys: frozenset[str] = frozenset()
    """Keys of the group's first stand-in's state lent to each stand-in stepped alone
    (:mod:`.first_parameter_values`)."""
    taken: int = 0
    """How many steps finished (the step that raised is the next)."""
    first_keys: list[set[str]] = dataclasses.field(default_factory=list)
    """The keys of each stand-in's state after the first step."""

    def run(self, twin: torch.optim.Optimizer) -> None:
        step = unhooked_step(twin)
        with step_hooks_silenced(twin), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _in_train_mode(twin)
            for step_index in range(PROBE_STEPS):
                grads = [
                    self.gradient_of(step_index, position, tuple(standin.shape), self.generator).to(standin.device)
                    for position, standin in enumerate(self.standins)
                ]
                if self.with_graph:
                    grads = _with_graph(self.standins, grads)
                for standin, grad in zip(self.standins, grads, strict=True):
                    standin.grad = grad
                if self.apart:
                    _step_one_at_a_time(twin, step, self.index, self.standins, self.lent_keys)
                else:
                    step()
                self.taken += 1
                if step_index == 0:
                    self.first_keys = [set(flat_state(twin.state.get(standin, {}))) for standin in self.standins]


def _in_train_mode(twin: torch.optim.Optimizer) -> None:
    """Put a twin built in eval mode in train mode, where it steps.

    Schedule-free optimizers step only in train mode and are built in eval mode (``train_mode`` ``False`` in their
    groups): users build, wrap, then call ``train()`` in their loop. The class's own ``train()`` runs on the twin,
    whose groups and states are its own; the optimizer stays in the mode it is in.
    """
    if "train" in outside_step_methods(twin) and not all(group.get("train_mode", True) for group in twin.param_groups):
        type(twin).train(twin)  # type: ignore[attr-defined]


def _standins(dim: int, device: torch.device, generator: torch.Generator) -> list[torch.Tensor]:
    """Two fp32 stand-in parameters on ``device``, of ``dim`` dimensions and different shapes, drawn from
    ``generator``."""
    shapes = [tuple(sizes[:dim]) for sizes in _STANDIN_SIZES]
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(device=device, dtype=torch.float32))
        for shape in shapes
    ]


def _with_graph(standins: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients that carry one graph over every stand-in, as ``loss.backward(create_graph=True)`` leaves them.

    The loss is ``sum(g_i * s_i) + _CROSS / 2 * (sum of every stand-in's elements) ** 2``: each gradient is ``g_i``
    plus a term that reads every stand-in, so the Hessian has cross terms between stand-ins, as a real model's has.
    """
    with torch.enable_grad():
        total = torch.stack([standin.sum() for standin in standins]).sum()
        loss = sum((grad * standin).sum() for grad, standin in zip(grads, standins, strict=True)) + (
            _CROSS / 2 * total * total
        )
        return list(torch.autograd.grad(loss, standins, create_graph=True))


def _lending_difference(together: _Outcome, apart: _Outcome | _Unknown) -> str | None:
    """What the stand-ins stepped one at a time with the first stand-in's values lent did otherwise than stepped
    together, or ``None``."""
    if isinstance(apart, _Unknown):
        return f"failed ({apart.reason})"
    if apart.failure is not None and together.failure is None:
        return f"failed ({apart.failure})"
    return together.difference(apart)


def _step_one_at_a_time(
    twin: torch.optim.Optimizer,
    step: Callable[[], Any],
    index: int,
    standins: list[torch.Tensor],
    first_keys: frozenset[str],
) -> None:
    """One probe step as swap-generic runs a step: each stand-in a batch of its own, group values kept per batch, the
    values of ``first_keys`` lent to each batch's first stand-in."""
    values = GroupValues(twin)
    first_values = FirstParameterValues(twin, first_keys)
    narrowed = NarrowedGroups(twin)
    target = twin.param_groups[index]
    for batch, standin in enumerate(standins):
        values.before_batch()
        with first_values.lent(target, [standin], [standin]):
            narrowed.run(step, target, [standin])
        values.after_batch(batch, held=target)


@contextlib.contextmanager
def _seeded_rng(device: torch.device) -> Iterator[None]:
    """The global RNG (and ``device``'s) forked and seeded alike for each twin; the caller's state comes back."""
    accelerator = device.type not in ("cpu", "meta")
    devices = [torch.device(device).index or 0] if accelerator else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if accelerator else "cuda"):
        torch.manual_seed(_SEED)
        yield


def _same_bits(first: torch.Tensor, second: torch.Tensor) -> bool:
    if first.shape != second.shape or first.dtype != second.dtype:
        return False
    return bool(torch.equal(first.reshape(-1).view(torch.uint8), second.reshape(-1).view(torch.uint8)))


def _same_state(first: object, second: object) -> bool:
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        if first.device.type == "meta" or type(first) not in (torch.Tensor, torch.nn.Parameter):
            return first.shape == second.shape and first.dtype == second.dtype
        return _same_bits(first.detach(), second.detach())
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return False
    if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)):
        return len(first) == len(second) and all(map(_same_state, first, second))
    if isinstance(first, dict) and isinstance(second, dict):
        return first.keys() == second.keys() and all(_same_state(first[k], second[k]) for k in first)
    return same_value(first, second)
