"""Parallelism built on the backend interfaces and the parallel layout.

``layout`` is the layout itself (``LayoutSpec``: the sizes a config asks for;
``ParallelLayout``: this rank's coordinates and process groups, named by ``Axis``), and
``settings`` the strict pydantic base of every config section; both load without torch
(``mtcore plan`` reads them).

Subpackages: ``tensor`` (tensor and sequence parallel layers, vocab-parallel
cross-entropy, model-parallel RNG), ``data`` and ``optimizer`` (data parallel,
ZeRO-1); ``recompute`` holds activation recomputation. Import from the
subpackages; this package re-exports nothing, so importing one part never pulls
in another.
"""
