"""swap-muon: ``torch.optim.Muon`` with its momentum buffers swapped to host memory between steps.

Installing the package is enough: it registers :class:`MuonAdapter` through the
``swap_core.adapters`` entry point, so ``swap_optimizer(torch.optim.Muon(...))``
finds it. :func:`split_muon_params` splits a model into the parameters Muon
should update and those AdamW should.
"""

from __future__ import annotations

from .__about__ import __version__
from .adapter import MuonAdapter, make_muon_adapter, register
from .distributed import DistributedMuonAdapter, PlanMismatchError
from .owner_plan import OwnerPlan, plan_owners
from .param_split import HEAD_MODULE_NAMES, NamePredicate, ParamAssignment, assign_muon_params, split_muon_params

__all__ = [
    "HEAD_MODULE_NAMES",
    "DistributedMuonAdapter",
    "MuonAdapter",
    "NamePredicate",
    "OwnerPlan",
    "ParamAssignment",
    "PlanMismatchError",
    "__version__",
    "assign_muon_params",
    "make_muon_adapter",
    "plan_owners",
    "register",
    "split_muon_params",
]
