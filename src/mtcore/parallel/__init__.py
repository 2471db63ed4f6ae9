"""Parallelism built on the backend interfaces and the parallel layout.

Subpackages: ``tensor`` (tensor and sequence parallel layers, vocab-parallel
cross-entropy, model-parallel RNG), ``data`` and ``optimizer`` (data parallel,
ZeRO-1); ``recompute`` holds activation recomputation. Import from the
subpackages; this package re-exports nothing, so importing one part never pulls
in another.
"""
