"""An out-of-tree mtcore model family: ``gmlp``, a causal gMLP language model."""

from mtcore_example_family.family import FAMILY, GMLPConfig

__all__ = ["FAMILY", "GMLPConfig"]
