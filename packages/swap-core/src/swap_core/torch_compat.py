"""The private torch APIs swap-core relies on, fenced in one module.

Each function names the private attribute it reads, and the torch versions it was checked
against. When torch moves one, the function raises :class:`TorchCompatError` saying which, rather
than failing somewhere deep in a teardown; ``tests/test_torch_compat.py`` exercises each of them.

Checked against torch 2.13.0.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gc
import importlib
import os
import sys
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeAlias, cast

import torch
import torch.distributed as dist
import torch.optim.optimizer as torch_optimizer
from torch.utils._python_dispatch import TorchDispatchMode  # the base of the simulator's op checks

__all__ = [
    "HOOK_REGISTRIES",
    "LOAD_STATE_DICT_HOOKS",
    "MODULES_BINDING_THE_DEFAULT_GROUP",
    "STATE_DICT_HOOKS",
    "OpOverload",
    "OpSchema",
    "TorchCompatError",
    "TorchDispatchMode",
    "clear_cuda_last_error",
    "current_backward_task",
    "hook_registries",
    "hook_registries_set_aside",
    "host_empty_cache",
    "import_modules_binding_the_default_group",
    "inside_reentrant_backward",
    "is_lr_scheduler_step_wrapper",
    "load_state_dict_hook_registries",
    "note_step_for_lr_schedulers",
    "op_schema",
    "optimizer_infos",
    "private_function",
    "profiler_enabled",
    "queue_backward_callback",
    "registered_process_groups",
    "release_device_mesh_groups",
    "remove_hooks",
    "runtime_library_function",
    "share_amp_scaling_support",
    "share_hook_registries",
    "step_hooks_silenced",
    "storage_id",
    "tensor_version",
    "unscale_gradients_",
]

MODULES_BINDING_THE_DEFAULT_GROUP = (
    "torch.distributed.nn.functional",  # def broadcast(tensor, src, group=group.WORLD), and nine more
    "torch.distributed.fsdp.sharded_grad_scaler",  # ShardedGradScaler(process_group=dist.group.WORLD)
    "torch.distributed.optim.zero_redundancy_optimizer",  # _broadcast_object(group=dist.group.WORLD)
)
"""torch modules whose functions take the default group as a default argument, bound at import.

Imported after ``init_process_group`` (``torch.distributed.fsdp`` imports the first one on its
way), they hold that group for the life of the process. Checked: torch 2.13."""


def optimizer_infos() -> list[Any]:
    """torch's own optimizer database, ``torch.testing._internal.common_optimizers.optim_db`` (checked: torch 2.13):
    an ``OptimizerInfo`` per optimizer class, with the inputs torch's optimizer tests step. Importing it needs
    expecttest, a test-only package: ``ModuleNotFoundError`` without it."""
    module = importlib.import_module("torch.testing._internal.common_optimizers")
    infos: list[Any] = _checked(module, "optim_db", list, user="optimizer_infos")
    return infos


def tensor_version(tensor: torch.Tensor) -> int:
    """How often ``tensor`` was written in place: autograd's version counter ``tensor._version``
    (checked: torch 2.13)."""
    version: int = _checked(tensor, "_version", int, user="tensor_version")
    return version


def current_backward_task() -> int:
    """The id of the autograd graph task running the current backward (the innermost one, inside a reentrant
    backward): ``torch._C._current_graph_task_id()``, ``-1`` outside any (checked: torch 2.13). Ids grow with every
    backward begun, so a nested backward's is above its outer one's."""
    task: int = _checked(torch._C, "_current_graph_task_id", types.BuiltinFunctionType, user="current_backward_task")()
    return task


_ENGINE_RUN = "_engine_run_backward"
"""The function in ``torch/autograd/graph.py`` through which ``backward()`` and ``autograd.grad`` run the engine
(checked: torch 2.13)."""


def inside_reentrant_backward() -> bool:
    """Whether the calling code runs in a backward that an autograd ``Function``'s ``backward`` started (a reentrant
    backward, as ``torch.utils.checkpoint`` with ``use_reentrant=True`` runs one for each segment): above the caller
    the engine was entered (``_engine_run_backward``) from inside a ``backward(ctx, ...)``. A hook called from a
    ``Function``'s ``backward`` in the same backward (FSDP2's post-backward) is not in one."""
    frame: types.FrameType | None = sys._getframe(1)
    entered_engine = False
    while frame is not None:
        code = frame.f_code
        if code.co_name == _ENGINE_RUN:
            entered_engine = True
        elif entered_engine and code.co_name == "backward" and code.co_varnames[:1] == ("ctx",):
            return True
        frame = frame.f_back
    return False


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward's graph task ends, if it ends without an error (the innermost
    one, inside a reentrant backward): ``Variable._execution_engine.queue_callback`` (checked: torch 2.13)."""
    engine = _checked(torch.autograd.Variable, "_execution_engine", object, user="queue_backward_callback")
    engine.queue_callback(callback)


def unscale_gradients_(grads: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """``GradScaler.unscale_``'s kernel on ``grads`` (one device, one dtype): each multiplied in place by
    ``inv_scale``, ``found_inf`` set to 1 where one holds an inf or a NaN
    (``torch._amp_foreach_non_finite_check_and_unscale_``; checked: torch 2.13)."""
    kernel = _checked(torch, "_amp_foreach_non_finite_check_and_unscale_", object, user="unscale_gradients_")
    kernel(list(grads), found_inf, inv_scale)


def _checked(owner: object, name: str, kind: type, *, user: str) -> Any:
    """``owner.name``, which must be a ``kind``; else a :class:`TorchCompatError` saying that ``user`` (a function of
    this module) needs updating for this torch."""
    value = getattr(owner, name, None)
    if not isinstance(value, kind):
        where = owner.__name__ if isinstance(owner, types.ModuleType) else f"torch.{type(owner).__name__}"
        raise TorchCompatError(
            f"{where}.{name} is gone (checked against torch 2.13): swap_core.torch_compat.{user} needs updating for "
            "this torch"
        )
    return value


def storage_id(storage: torch.UntypedStorage) -> int:
    """The identity of a storage, stable across ``resize_``: ``UntypedStorage._cdata``, the address of its
    ``StorageImpl`` (checked: torch 2.13). The simulator keys its memory records by it."""
    return int(storage._cdata)


OpOverload: TypeAlias = torch._ops.OpOverload
"""The type of one op overload a dispatch mode sees (``torch._ops.OpOverload``; checked: torch 2.13)."""


@dataclasses.dataclass(frozen=True)
class OpSchema:
    """What the schema of one op overload says, read from torch's private ``OpOverload._schema``."""

    name: str
    """``func._name``, e.g. ``aten::add_.Tensor``."""
    packet: str
    """The overload packet's name, e.g. ``add_``."""
    is_view: bool
    written_arguments: tuple[tuple[int, str], ...]
    """(position, name) of each argument the op writes (``Tensor(a!)``, ``Tensor(a!)[]``)."""
    returns_non_tensor: bool
    """Whether some result is not a tensor (e.g. ``aten::item``: a value read back to the host)."""


def op_schema(func: OpOverload) -> OpSchema:
    """:class:`OpSchema` of ``func``: its ``_schema`` arguments' alias info and return types (checked: torch 2.13)."""
    schema = func._schema
    written = tuple(
        (index, arg.name)
        for index, arg in enumerate(schema.arguments)
        if arg.alias_info is not None and bool(arg.alias_info.is_write)
    )
    return OpSchema(
        name=func._name,
        packet=func.overloadpacket.__name__,
        is_view=bool(func.is_view),
        written_arguments=written,
        returns_non_tensor=any("Tensor" not in str(ret.type) for ret in schema.returns),
    )


def profiler_enabled() -> bool:
    """Whether a torch profiler runs (``torch.profiler.profile``, ``emit_nvtx``, ``emit_itt``): the flag
    ``torch.autograd.profiler._is_profiler_enabled`` they set, which torch's own code reads (checked: torch 2.13)."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


class TorchCompatError(RuntimeError):
    """A private torch API that swap relies on has moved; the message names it and the versions checked."""


def private_function(module: str, name: str, *, user: str, checked: str = "torch 2.13") -> Callable[..., Any]:
    """``module.name``, a private torch function a swap package calls, or :class:`TorchCompatError` naming it.

    For the ``torch_compat`` module of each package: ``user`` says who calls it and why, for the message
    a user sees when torch has moved it (checked against ``checked``).
    """
    try:
        function = getattr(importlib.import_module(module), name, None)
    except ImportError:
        function = None
    if not callable(function):
        raise TorchCompatError(
            f"torch {torch.__version__} has no {module}.{name} (checked: {checked}), which {user}; "
            "this swap release needs a torch it was checked against"
        )
    return cast("Callable[..., Any]", function)


def import_modules_binding_the_default_group() -> None:
    """Import :data:`MODULES_BINDING_THE_DEFAULT_GROUP` now; call it before ``init_process_group``.

    Imported while no group exists, their default arguments hold ``None`` (the default group at call
    time) instead of a reference that would keep the first group alive past its destruction.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "import_modules_binding_the_default_group() must run before init_process_group(): imported now, "
            f"{', '.join(MODULES_BINDING_THE_DEFAULT_GROUP)} would hold the default group for good"
        )
    with warnings.catch_warnings():
        # torch.distributed.optim scripts functions with torch.jit, which warns about its own deprecation.
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in MODULES_BINDING_THE_DEFAULT_GROUP:
            importlib.import_module(name)


HOOK_REGISTRIES = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)
"""The per-instance hook registries of ``torch.optim.Optimizer`` (ordered dicts; checked: torch 2.13)."""

LOAD_STATE_DICT_HOOKS = ("_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")
"""The registries of ``load_state_dict``'s pre and post hooks, in that order."""

STATE_DICT_HOOKS = ("_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks")
"""The registries of ``state_dict``'s pre and post hooks, in that order."""

_INSTANCE_STEP_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
_GLOBAL_STEP_HOOKS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
"""``torch.optim.optimizer``'s module dicts of the hooks ``register_optimizer_step_pre/post_hook`` add."""


def share_hook_registries(wrapper: torch.optim.Optimizer, wrapped: torch.optim.Optimizer) -> None:
    """Set up on ``wrapper`` the hook machinery ``torch.optim.Optimizer.__init__`` sets up, shared with ``wrapped``.

    ``wrapper`` gets ``wrapped``'s own registries (:data:`HOOK_REGISTRIES`, the same dict objects,
    created on ``wrapped`` where missing), so a hook registered through either handle, before or after
    wrapping, is one hook; then its ``step`` is patched for the profiler as torch's ``__init__`` does
    (``Optimizer._patch_step_function``). ``Optimizer.__init__`` itself cannot be called for this: it
    would add ``wrapped``'s param groups a second time.
    """
    patch = getattr(torch.optim.Optimizer, "_patch_step_function", None)
    if patch is None:
        raise TorchCompatError(
            f"torch {torch.__version__} has no torch.optim.Optimizer._patch_step_function (checked: torch 2.13); "
            "swap_core.torch_compat.share_hook_registries needs updating for this torch"
        )
    for name in HOOK_REGISTRIES:
        hooks = wrapped.__dict__.get(name)
        if hooks is None:
            hooks = OrderedDict()
            setattr(wrapped, name, hooks)
        setattr(wrapper, name, hooks)
    patch(wrapper)


def hook_registries(optimizer: torch.optim.Optimizer) -> dict[str, dict[Any, Callable[..., Any]]]:
    """``optimizer``'s own hook registries (of :data:`HOOK_REGISTRIES`) that exist, by name (the live dicts)."""
    return {
        name: optimizer.__dict__[name] for name in HOOK_REGISTRIES if isinstance(optimizer.__dict__.get(name), dict)
    }


def share_amp_scaling_support(
    wrapper: torch.optim.Optimizer, wrapped: torch.optim.Optimizer, *, always: bool = False
) -> None:
    """``wrapper`` tells ``GradScaler`` what ``wrapped`` tells it: whether its ``step`` unscales and skips inf steps
    itself (fused optimizers), read from ``optimizer._step_supports_amp_scaling`` (checked: torch 2.13).
    ``always``: it says so whatever ``wrapped`` says, so that ``GradScaler.step`` leaves the gradients to it and
    hands it ``grad_scale``/``found_inf`` (what ``SwapConfig(step="in_backward")`` refuses by)."""
    supported = always or getattr(wrapped, "_step_supports_amp_scaling", False)
    wrapper._step_supports_amp_scaling = supported  # type: ignore[attr-defined]


def is_lr_scheduler_step_wrapper(method: object) -> bool:
    """Whether ``method`` is the wrapper an LR scheduler puts on an optimizer instance's ``step`` to note that it
    was called (marked ``_wrapped_by_lr_sched``; checked: torch 2.13)."""
    return bool(getattr(method, "_wrapped_by_lr_sched", False))


def load_state_dict_hook_registries(
    optimizer: torch.optim.Optimizer,
) -> tuple[dict[Any, Callable[..., Any]], dict[Any, Callable[..., Any]]]:
    """``optimizer``'s ``load_state_dict`` pre-hook and post-hook registries (the live dicts, in the order their
    hooks run; empty ones for an optimizer that never had any)."""
    pre, post = (optimizer.__dict__.get(name, {}) for name in LOAD_STATE_DICT_HOOKS)
    return pre, post


def remove_hooks(optimizer: torch.optim.Optimizer, is_removed: Callable[[Callable[..., Any]], bool]) -> None:
    """Remove from every hook registry of ``optimizer`` (:data:`HOOK_REGISTRIES`) the hooks ``is_removed`` picks."""
    for name in HOOK_REGISTRIES:
        hooks = optimizer.__dict__.get(name, {})
        for handle in [handle for handle, hook in hooks.items() if is_removed(hook)]:
            del hooks[handle]


@contextlib.contextmanager
def hook_registries_set_aside(optimizer: torch.optim.Optimizer, names: Sequence[str]) -> Iterator[None]:
    """``optimizer``'s hook registries ``names`` (of :data:`HOOK_REGISTRIES`) are empty inside the block.

    The same dict objects are put back after it, whatever happens; a hook registered inside the block
    is dropped with the empty dict. For running one of the optimizer's own methods without the hooks
    that its caller runs itself.
    """
    unknown = [name for name in names if name not in HOOK_REGISTRIES]
    if unknown:
        raise ValueError(f"Not hook registries of torch.optim.Optimizer: {unknown}; expected some of {HOOK_REGISTRIES}")
    saved = {name: optimizer.__dict__[name] for name in names if name in optimizer.__dict__}
    try:
        for name in saved:
            setattr(optimizer, name, OrderedDict())
        yield
    finally:
        for name, hooks in saved.items():
            setattr(optimizer, name, hooks)


@contextlib.contextmanager
def step_hooks_silenced(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """No step pre/post hook runs inside the block, neither ``optimizer``'s own nor the global ones.

    A subclass whose ``step`` calls ``super().step()`` reaches the parent's hooked ``step`` (once
    any instance of the parent exists), which would run the hooks once per batch. The hooks live in
    ``optimizer._optimizer_step_pre_hooks``/``_post_hooks`` and in the module dicts
    ``torch.optim.optimizer._global_optimizer_pre_hooks``/``_post_hooks`` (checked: torch 2.13);
    each is replaced by an empty dict for the block and put back after it.
    """
    for name in _GLOBAL_STEP_HOOKS:
        if not isinstance(getattr(torch_optimizer, name, None), dict):
            raise TorchCompatError(
                f"torch.optim.optimizer.{name} is gone (checked against torch 2.13): "
                "swap_core.torch_compat.step_hooks_silenced needs updating for this torch"
            )
    saved_global = {name: getattr(torch_optimizer, name) for name in _GLOBAL_STEP_HOOKS}
    try:
        for name in saved_global:
            setattr(torch_optimizer, name, OrderedDict())
        with hook_registries_set_aside(optimizer, _INSTANCE_STEP_HOOKS):
            yield
    finally:
        for name, hooks in saved_global.items():
            setattr(torch_optimizer, name, hooks)


def note_step_for_lr_schedulers(optimizer: torch.optim.Optimizer) -> None:
    """Tell an LR scheduler built on ``optimizer`` (before it was wrapped) that it was stepped.

    The scheduler wraps the instance's ``step`` to set ``_opt_called`` and warns at its first
    ``step()`` when the flag is missing; a swapped step never calls that wrapper. Sets
    ``optimizer._opt_called`` only where such a wrapper is installed (checked: torch 2.13).
    """
    if is_lr_scheduler_step_wrapper(vars(optimizer).get("step")):
        optimizer._opt_called = True  # type: ignore[attr-defined]


def registered_process_groups() -> list[dist.ProcessGroup]:
    """Every process group torch.distributed knows of: the default group, ``new_group``s, DeviceMesh groups.

    Reads ``torch.distributed.distributed_c10d._world.pg_map`` (checked: torch 2.13).
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    if not isinstance(pg_map, dict):
        raise TorchCompatError(
            "torch.distributed.distributed_c10d._world.pg_map is gone (checked against torch 2.13): "
            "swap_core.torch_compat.registered_process_groups needs updating for this torch"
        )
    return list(pg_map)


def release_device_mesh_groups() -> int:
    """Drop the process groups that live DeviceMeshes still hold; return how many meshes held any.

    Every ``DeviceMesh`` keeps its groups in ``_pg_registry`` (strong references, for torch.compile)
    and ``destroy_process_group`` does not clear it; meshes themselves live on in DTensor's sharding
    caches long after the model is gone. Call this only after ``destroy_process_group``: the groups are
    unusable by then, and dropping them lets their C++ objects (and gloo's worker threads) go now.
    Reads ``DeviceMesh._pg_registry`` (checked: torch 2.13).
    """
    from torch.distributed.device_mesh import DeviceMesh

    released = 0
    for candidate in gc.get_objects():
        # The MRO, not isinstance: DeviceMesh's metaclass would probe every object (deprecated ones warn).
        if DeviceMesh not in type(candidate).__mro__:
            continue
        registry = candidate.__dict__.get("_pg_registry")
        if registry is None:
            continue
        if not isinstance(registry, dict):
            raise TorchCompatError(
                f"DeviceMesh._pg_registry is a {type(registry).__name__}, not a dict (checked against torch "
                "2.13): swap_core.torch_compat.release_device_mesh_groups needs updating for this torch"
            )
        if registry:
            registry.clear()
            released += 1
    return released


def host_empty_cache(device_type: str) -> None:
    """Give back the pinned blocks torch's caching host allocator keeps for ``device_type``; nothing where there is no
    such call. CUDA: ``torch._C._host_emptyCache`` (private; checked: torch 2.13); NPU: torch_npu's
    ``torch.npu.host_empty_cache``."""
    if device_type == "cuda":
        empty = getattr(torch._C, "_host_emptyCache", None)
    else:
        empty = getattr(getattr(torch, device_type, None), "host_empty_cache", None)
    if callable(empty):
        empty()


_PROCESS_MAPS = "/proc/self/maps"


def clear_cuda_last_error() -> int:
    """Read and reset the calling thread's last CUDA runtime error; return its code (0: there was none).

    A runtime call that fails records its status as the thread's *last error*, and torch's
    ``C10_CUDA_KERNEL_LAUNCH_CHECK`` after the next kernel launch raises it as if the launch had failed.
    ``torch.cuda.cudart()``'s ``cudaHostRegister`` returns the failed status without resetting it
    (``C10_CUDA_ERROR_HANDLED``), and torch binds no ``cudaGetLastError`` (checked: torch 2.13,
    ``torch/csrc/cuda/shared/cudart.cpp``). So this calls ``cudaGetLastError`` (``hipGetLastError`` on a
    ROCm build) of the runtime library torch loaded, found by :func:`runtime_library_function`.
    """
    hip = torch.version.hip is not None
    symbol, library = ("hipGetLastError", "libamdhip64.so") if hip else ("cudaGetLastError", "libcudart.so")
    return int(runtime_library_function(symbol, library)())


@functools.cache
def runtime_library_function(symbol: str, library: str) -> Callable[[], int]:
    """``symbol``, an ``int f(void)`` of the ``library*`` shared library this process already loaded.

    Never loads a second copy (a second CUDA runtime would have its own per-thread state). Looked up in
    the one ``library*`` file mapped into the process (``/proc/self/maps``, opened ``RTLD_NOLOAD``), else
    in the process's global namespace, where torch puts its CUDA runtime (``libtorch_global_deps`` is
    loaded ``RTLD_GLOBAL`` and depends on it; checked: torch 2.13 ``torch/__init__.py``). Raises
    :class:`TorchCompatError` naming the symbol where neither has it.
    """
    mapped = _mapped_libraries(library)
    candidates: list[str | None] = [mapped[0]] if len(mapped) == 1 else []
    candidates.append(None)  # the global namespace
    for path in candidates:
        try:
            handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY) if path else ctypes.CDLL(None)
            function = getattr(handle, symbol)
        except (OSError, AttributeError, TypeError):  # TypeError: no global namespace (Windows)
            continue
        function.restype = ctypes.c_int
        function.argtypes = []
        return cast("Callable[[], int]", function)
    found = f"mapped: {', '.join(mapped)}" if mapped else f"no {library}* is mapped into this process"
    raise TorchCompatError(
        f"no {symbol} found in the runtime library torch {torch.__version__} loaded ({found}; checked: torch 2.13), "
        "so swap cannot reset the error a failed host registration leaves behind, which the next kernel launch "
        "would raise. Use SwapConfig(host_memory='caching'), which registers nothing"
    )


def _mapped_libraries(library: str) -> list[str]:
    """The distinct files named ``library*`` mapped into this process (empty where ``/proc`` is missing)."""
    try:
        with open(_PROCESS_MAPS, encoding="utf-8", errors="replace") as maps:
            fields = [line.split(maxsplit=5) for line in maps]
    except OSError:
        return []
    paths = {parts[5].strip().removesuffix(" (deleted)") for parts in fields if len(parts) == 6}
    return sorted(path for path in paths if os.path.basename(path).startswith(library))
