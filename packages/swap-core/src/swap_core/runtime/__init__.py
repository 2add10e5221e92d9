"""Mechanism: slots, packed host memory and staging arenas, partitioning, the pipeline."""

__all__: list[str] = []
