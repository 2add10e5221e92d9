"""Ending a torch.distributed run cleanly: every process group destroyed while the interpreter is fully alive.

:func:`destroy_process_groups` (or :func:`initialized_process_group` around the work) is the teardown swap asks of
every distributed script (docs/distributed-endings.md): it destroys each process group and raises
if one outlives it, instead of a SIGABRT at interpreter exit in one run out of ten or twenty (see its docstring).

Importing this module before ``init_process_group`` imports the torch modules that would otherwise bind the default
group as a default argument (:data:`~swap_core.torch_compat.MODULES_BINDING_THE_DEFAULT_GROUP`).
"""

from __future__ import annotations

import contextlib
import gc
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from .torch_compat import (
    import_modules_binding_the_default_group,
    registered_process_groups,
    release_device_mesh_groups,
)

__all__ = ["ProcessGroupLeakError", "destroy_process_groups", "initialized_process_group"]

if dist.is_available() and not dist.is_initialized():
    # Imported before init_process_group (as imports usually are), these torch modules bind no group.
    import_modules_binding_the_default_group()


class ProcessGroupLeakError(RuntimeError):
    """A process group outlived :func:`destroy_process_groups`; the message names what still holds it."""


def destroy_process_groups() -> None:
    """Destroy every process group now, while the interpreter is fully alive; raise if one survives.

    Why: ``destroy_process_group`` only forgets the groups. A group whose Python object is still
    referenced keeps its C++ backend, and gloo's worker threads, until interpreter exit. A worker that
    then releases the last reference to a collective's tensor (a finished work, freed late because a
    barrier held it) must take the GIL to free the tensor's Python object; during finalization Python
    3.11-3.13 ends such a thread with ``pthread_exit``, whose unwinding through a C++ destructor calls
    ``std::terminate``: "terminate called without an active exception", SIGABRT, after all the work
    succeeded. Any run with a DeviceMesh is exposed: a mesh holds its groups in a registry that
    ``destroy_process_group`` leaves alone, and DTensor's sharding caches keep meshes alive. So is any
    run that first imports ``torch.distributed.fsdp`` after ``init_process_group``: a module it imports
    binds the default group as a default argument (see :func:`initialized_process_group`).

    So, in order: collect garbage (FSDP modules sit in reference cycles); ``barrier``, so that no
    rank destroys a group its peer still uses; ``destroy_process_group``; drop the groups that live
    meshes still hold; collect again; check that no group object is left. A group still referenced
    (a model, optimizer or mesh the caller keeps) raises :class:`ProcessGroupLeakError` naming its
    holders: a deterministic error instead of an abort in one exit out of ten or twenty. Release
    such objects before calling this. On a failure path, where a peer may be gone, call
    ``destroy_process_group`` alone, as :func:`initialized_process_group` does.
    """
    if not dist.is_initialized():
        return
    gc.collect()
    dist.barrier()
    groups = [(group.group_name, weakref.ref(group)) for group in registered_process_groups()]
    dist.destroy_process_group()
    release_device_mesh_groups()
    gc.collect()
    leaks = []
    for name, reference in groups:
        group = reference()
        if group is not None:
            leaks.append(f"group {name!r} held by {_holders(group)}")
    if leaks:
        raise ProcessGroupLeakError(
            "process groups outlived destroy_process_group(), so gloo's worker threads would live into "
            f"interpreter exit and can abort it (SIGABRT): {'; '.join(leaks)}. Drop the models, optimizers "
            "and meshes that hold them before the teardown."
        )


@contextlib.contextmanager
def initialized_process_group(backend: str = "gloo", **init_options: Any) -> Iterator[None]:
    """``init_process_group(backend, **init_options)`` for the block; :func:`destroy_process_groups` after it.

    Build models, meshes and optimizers in a function called inside the block, so that they are gone
    when the block ends (a name bound in the block itself would keep its group alive). Before the
    init, the torch modules that would bind the default group as a default argument are imported
    (:data:`~swap_core.torch_compat.MODULES_BINDING_THE_DEFAULT_GROUP`). When the block raises, the
    groups are destroyed without the barrier and the leak check, and the error propagates.
    """
    import_modules_binding_the_default_group()
    dist.init_process_group(backend, **init_options)
    try:
        yield
    except BaseException:
        # No barrier (a peer may be gone) and no leak check (the traceback holds the block's objects).
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    destroy_process_groups()


def _holders(obj: object) -> str:
    """What refers to ``obj``: object types, the owner of an attribute dict, a function holding it as a default."""
    names = set()
    for referrer in gc.get_referrers(obj):
        if isinstance(referrer, types.FrameType):
            continue
        if isinstance(referrer, dict):
            owners = {
                type(owner).__name__
                for owner in gc.get_referrers(referrer)
                if getattr(owner, "__dict__", None) is referrer
            }
            names.add(f"a dict of {', '.join(sorted(owners))}" if owners else "a dict")
        elif not isinstance(referrer, tuple):
            names.add(type(referrer).__name__)
    # A tuple of objects the collector does not track (a group is one) is untracked too: look for the
    # functions that hold the group as a default argument.
    functions = sorted(
        f"{function.__module__}.{function.__qualname__}"
        for function in gc.get_objects()
        if isinstance(function, types.FunctionType) and _is_default_argument(obj, function)
    )
    if functions:
        names.add(
            f"the default arguments of {', '.join(functions)} (imported after init_process_group; import them "
            "before, as importing swap_core.distributed does)"
        )
    return "; ".join(sorted(names)) or "an object outside Python's garbage collector"


def _is_default_argument(obj: object, function: types.FunctionType) -> bool:
    defaults = (*(function.__defaults__ or ()), *(function.__kwdefaults__ or {}).values())
    return any(value is obj for value in defaults)
