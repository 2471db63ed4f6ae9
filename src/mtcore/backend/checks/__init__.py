"""Checks of a backend against the reference: the cases and collective checks that the
conformance kit (``mtcore.testing.conformance``, a pytest plugin) runs, and the fast
self-check (``selfcheck``) that `mtcore train` runs before step 1.

They live in the backend layer because training runs them: the trainer may import
down the layers, never up into ``mtcore.testing``.
"""
