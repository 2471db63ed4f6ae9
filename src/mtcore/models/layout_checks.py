"""Layout checks every stack of transformer blocks shares (each family's ``check_layout``).

What a family refuses outright (cp, ep for a dense model) it says in its own words;
the splits below follow from the blocks alone: tp splits each feed-forward's hidden
units, and pp * vpp pipeline chunks take equal runs of layers.
"""

from __future__ import annotations

from mtcore.distributed.layout import LayoutError, LayoutSpec


def check_block_split(num_layers: int, ffn_size: int, spec: LayoutSpec) -> None:
    """Raise ``LayoutError``, naming the numbers, unless tp divides ``ffn_size`` and
    pp * vpp divides ``num_layers``."""
    if ffn_size % spec.tp:
        raise LayoutError(f"ffn_hidden_size={ffn_size} is not divisible by tp={spec.tp}")
    stages = spec.pp * spec.vpp
    if num_layers % stages:
        raise LayoutError(
            f"{num_layers} layers are not divisible by pp*vpp = {spec.pp}*{spec.vpp} = "
            f"{stages} pipeline chunks"
        )
