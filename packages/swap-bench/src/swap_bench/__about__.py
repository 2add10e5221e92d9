"""The version of swap-bench (bumped with ``hatch version``)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
