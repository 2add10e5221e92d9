"""The private torch APIs swap-bench relies on, fenced in one module.

The planner models distributed Muon on one rank of a world that does not exist: torch's *fake* process
group backend (``torch.testing._internal.distributed.fake_pg``) answers every collective without moving
data, which is all a step over meta tensors needs. Importing that module registers the backend under the
name ``"fake"``. Checked against torch 2.13.0; ``tests/test_planner.py`` exercises it.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from swap_core.torch_compat import TorchCompatError

__all__ = ["FAKE_BACKEND", "register_fake_process_group_backend"]

FAKE_BACKEND = "fake"
"""The name ``init_process_group`` takes for torch's fake process group."""

_FAKE_PG_MODULE = "torch.testing._internal.distributed.fake_pg"


def register_fake_process_group_backend() -> None:
    """Make ``init_process_group("fake", ...)`` available, or raise :class:`TorchCompatError` naming the module."""
    try:
        importlib.import_module(_FAKE_PG_MODULE)
    except ImportError as error:
        raise TorchCompatError(
            f"torch {torch.__version__} has no {_FAKE_PG_MODULE} (checked: torch 2.13), whose fake process group "
            "swap-bench plan --tables uses to model distributed Muon; this swap-bench release needs a torch it was "
            "checked against"
        ) from error
    if FAKE_BACKEND not in dist.Backend.backend_list:
        raise TorchCompatError(
            f"importing {_FAKE_PG_MODULE} did not register the {FAKE_BACKEND!r} process group backend in torch "
            f"{torch.__version__} (checked: torch 2.13)"
        )
