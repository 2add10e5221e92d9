"""fp32 master weights of bf16/fp16 parameters, kept as optimizer state and swapped with the others.

With ``SwapConfig(master_weights=True)`` every parameter in a low-precision floating dtype
(:data:`LOW_PRECISION_DTYPES`) gets an fp32 copy under the state key :data:`MASTER_KEY`, or, for a bf16 parameter
whose updates all run in ``step()``, the bits of it the parameter lacks under :data:`REMAINDER_KEY`
(:mod:`~swap_core.master_weights.remainder`; :func:`master_of` reads either form as fp32). The
family's update runs on that copy, as if it were the parameter, with the gradient upcast to fp32
and fp32 states; the parameter is then set from it (``param.copy_(master)``, round to nearest
even). The reference, which the tests hold every family to bitwise, is the plain optimizer built
over fp32 leaf copies ``m = p.detach().float()``, each step ``m.grad = p.grad.float()``,
``step()``, then ``p.copy_(m)``.

The mechanism lives here once (the runtime calls it); adapters never see a low-precision parameter
in master mode, only its master, so none of them re-implements it.
"""

from __future__ import annotations

from ..runtime.state_keys import MASTER_KEY, MASTER_KEYS, REMAINDER_KEY, is_fresh
from .export import master_state_dict
from .fp32_view import master_of
from .outside_step import outside_step_on_masters
from .params import (
    LOW_PRECISION_DTYPES,
    MASTER_DTYPE,
    MasterPair,
    has_master,
    master_problem,
    model_param,
    stand_in,
    without_master,
)
from .update import OnMasters, UpdateOnMasters, masters_presented, on_masters, params_as_masters

__all__ = [
    "LOW_PRECISION_DTYPES",
    "MASTER_DTYPE",
    "MASTER_KEY",
    "MASTER_KEYS",
    "REMAINDER_KEY",
    "MasterPair",
    "OnMasters",
    "UpdateOnMasters",
    "has_master",
    "is_fresh",
    "master_of",
    "master_problem",
    "master_state_dict",
    "masters_presented",
    "model_param",
    "on_masters",
    "outside_step_on_masters",
    "params_as_masters",
    "stand_in",
    "without_master",
]
