"""Tokens through a rank's pipeline chunks to full logits: how the HF interop tests run
an imported model under tp x pp (blocking p2p, as the engine's evaluation does).

Kept free of transformers so that the ranks, which import the test module, do not
import it too (each import costs seconds on a loaded machine).
"""

from __future__ import annotations

import torch

from mtcore.backend.collective import P2P
from mtcore.parallel.layout import Axis


def forward_logits(chunks, layout, collective, tokens: torch.Tensor):
    """Every virtual stage in order; the full ``[b, s, vocab]`` logits on the last
    stage's ranks (gathered over tp), None on the others."""
    pp_ranks, r = layout.ranks_of[Axis.PP], layout.pp_rank
    group = layout.group(Axis.PP)
    seq = tokens.shape[1] // layout.tp if chunks[0].c.sequence_parallel else tokens.shape[1]
    shape = (tokens.shape[0], seq, chunks[0].config.hidden_size)
    for c, chunk in enumerate(chunks):
        x = tokens
        if not (r == 0 and c == 0):
            x = torch.empty(shape)
            recv = P2P("recv", x, pp_ranks[(r - 1) % layout.pp], group)
            for h in collective.batch_send_recv([recv]):
                h.wait()
        out = chunk(x)
        if chunk.last:
            return chunk.tp.all_gather(out, dim=-1)  # [b, s, vocab / tp] -> [b, s, vocab]
        send = P2P("send", out.contiguous(), pp_ranks[(r + 1) % layout.pp], group)
        for h in collective.batch_send_recv([send]):
            h.wait()
    return None
