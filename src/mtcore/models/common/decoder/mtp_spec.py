"""Multi-token prediction's settings (``decoder.mtp`` builds the modules): a config holds
them without torch."""

from __future__ import annotations

from pydantic import Field

from mtcore.parallel.settings import Settings


class MTPSpec(Settings):
    """``depth`` prediction modules; their losses weigh ``loss_weight`` in all."""

    depth: int = Field(1, ge=1)
    loss_weight: float = Field(0.3, gt=0.0)
