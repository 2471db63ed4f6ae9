"""Parallel layout and process groups, built on the collective interface."""

from mtcore.distributed.layout import LayoutError, LayoutSpec, ParallelLayout

__all__ = ["LayoutError", "LayoutSpec", "ParallelLayout"]
