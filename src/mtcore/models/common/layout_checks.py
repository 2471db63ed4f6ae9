"""Layout checks every stack of transformer blocks shares (each family's ``check_layout``).

What a family refuses outright (cp, ep for a dense model) it says in its own words;
the splits below follow from the blocks alone: tp splits each feed-forward's hidden
units, and pp * vpp pipeline chunks take equal runs of layers (or the first and last
pipeline ranks the layer counts the layout gives them, ``split.uneven_counts``).
"""

from __future__ import annotations

from mtcore.parallel.layout import LayoutError, LayoutSpec
from mtcore.parallel.pipeline import SplitError, layer_counts


def check_block_split(num_layers: int, ffn_size: int, spec: LayoutSpec) -> None:
    """Raise ``LayoutError``, naming the numbers, unless tp divides ``ffn_size`` and the
    layers split over the pp * vpp pipeline chunks (evenly, or as the layout's first and
    last stage layer counts say)."""
    if ffn_size % spec.tp:
        raise LayoutError(f"ffn_hidden_size={ffn_size} is not divisible by tp={spec.tp}")
    if spec.uneven:
        try:
            layer_counts(
                num_layers,
                spec.pp,
                spec.vpp,
                first=spec.first_stage_layers,
                last=spec.last_stage_layers,
            )
        except SplitError as e:
            raise LayoutError(str(e)) from None
        return
    stages = spec.pp * spec.vpp
    if num_layers % stages:
        raise LayoutError(
            f"{num_layers} layers are not divisible by pp*vpp = {spec.pp}*{spec.vpp} = "
            f"{stages} pipeline chunks"
        )
