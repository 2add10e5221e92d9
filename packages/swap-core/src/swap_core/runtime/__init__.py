"""Mechanism: slots, the store of host mirrors, packed host memory and staging arenas, partitioning, the plan and the
pipeline that walks it.

Every module here is swap-core's own: no family package imports them. What an adapter may use is public in
:mod:`swap_core.adapters` (docs/adapters.md).
"""

__all__: list[str] = []
