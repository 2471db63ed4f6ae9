"""What LoRA (``finetune.lora``) changes in a rank's memory: the base weights are frozen
(held, in the model dtype, with no gradient buffer, master weight or AdamW state) and
only the adapters train.

Per adapted linear of a block, on one tp rank (``mtcore.parallel.tensor.lora``): a
column-parallel one (q, k, v, fc1's gate and up) holds A ``[r, in]`` whole and its
``out / tp`` rows of B ``[out, r]``; a row-parallel one (o, fc2) its ``in / tp``
columns of A and B whole. Latent attention's and the routed experts' adapters are not
counted (``adapter_params`` says so in its note).
"""

from __future__ import annotations

from mtcore.plan.shapes import Block


def adapter_params(block: Block, lora, tp: int) -> tuple[float, str | None]:
    """Adapter parameters of one ``block`` on one tp rank, and a note when some targets
    are not counted (None otherwise)."""
    r, targets, h = lora.rank, set(lora.targets), block.hidden
    q, kv = block.heads * block.head_dim, block.kv_heads * block.head_dim

    def column(out: float) -> float:
        return r * h + r * out / tp

    def row(inner: float) -> float:
        return r * inner / tp + r * h

    total, note = 0.0, None
    if block.latent is not None:
        note = "lora: adapters on latent attention are not counted"
    else:
        total += sum(
            column(out) for name, out in (("q", q), ("k", kv), ("v", kv)) if name in targets
        )
        total += row(q) if "o" in targets else 0.0
    ffn = block.ffn or block.shared_ffn
    if ffn:
        total += (2 if block.gated else 1) * column(ffn) if "fc1" in targets else 0.0
        total += row(ffn) if "fc2" in targets else 0.0
    return total, note
