"""Test support shipped with swap-core for swap's own suites and for family packages.

``swap_core.testing.pytest_plugin`` adds the ``--backend sim|cuda|npu`` option and the
backend fixtures; load it with ``pytest_plugins = ("swap_core.testing.pytest_plugin",)``
in a root ``conftest.py``. Further modules here hold the adapter conformance suite and
the distributed test harness.
"""

from __future__ import annotations

__all__: list[str] = []
