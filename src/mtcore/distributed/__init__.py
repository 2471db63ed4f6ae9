"""Parallel layout and process groups, built on the collective interface."""

from mtcore.distributed.layout import Axis, GroupView, LayoutError, LayoutSpec, ParallelLayout

__all__ = ["Axis", "GroupView", "LayoutError", "LayoutSpec", "ParallelLayout"]
