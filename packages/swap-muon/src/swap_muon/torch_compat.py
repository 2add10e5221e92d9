"""The private torch APIs swap-muon relies on, fenced in one module.

torch keeps Muon's math in the private module ``torch.optim._muon``: ``muon`` (the function
``Muon.step`` calls, which ``MuonAdapter`` runs per batch), and ``_zeropower_via_newtonschulz`` and
``_adjust_lr`` (which distributed Muon runs on the owner rank's whole matrix). Checked against
torch 2.13.0; when torch moves one, importing swap-muon raises
:class:`~swap_core.torch_compat.TorchCompatError` naming it
(``tests/test_muon_torch_compat.py``).
"""

from __future__ import annotations

from swap_core.torch_compat import private_function

__all__ = ["PRIVATE_FUNCTIONS", "adjust_lr", "muon", "zeropower_via_newtonschulz"]

PRIVATE_FUNCTIONS = ("muon", "_zeropower_via_newtonschulz", "_adjust_lr")
"""The functions of ``torch.optim._muon`` used (checked: torch 2.13)."""

_MODULE = "torch.optim._muon"
_USER = "swap-muon runs as Muon.step does"

muon = private_function(_MODULE, "muon", user=_USER)
"""``torch.optim._muon.muon``: Muon's update of a list of parameters, as ``Muon.step`` calls it."""

zeropower_via_newtonschulz = private_function(_MODULE, "_zeropower_via_newtonschulz", user=_USER)
"""Newton-Schulz orthogonalization of one matrix, with Muon's coefficients, steps and eps."""

adjust_lr = private_function(_MODULE, "_adjust_lr", user=_USER)
"""Muon's learning-rate adjustment for a matrix's shape (``adjust_lr_fn``)."""
