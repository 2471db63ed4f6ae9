"""All-to-all dispatch that sends each token once per destination rank.

The plain all-to-all dispatcher sends one row per (token, expert) assignment,
so a token whose k experts share a rank crosses the wire up to k times. Here
a token goes once to each rank that holds at least one of its kept experts,
with a small ``[rows, 2 * E_local]`` side tensor (its combine weights and a
choice mask for that rank's experts). The receiver expands rows into
assignments for its grouped matmul and sums each token's weighted expert
outputs *before* sending them back, so the return trip is deduplicated too.

Per rank and direction that is ``T * (distinct destination ranks per token)``
rows instead of ``T * k``: the same at top-1; at top-k at least ``k / min(k, ep)``
times fewer, up to ``k`` times when all of a token's experts share a rank. The price: weights applied on the expert side (their gradient
travels back through the all-to-all) and one more index step per side.
"""

from __future__ import annotations

import torch

from mtcore.parallel.moe.dispatch import AllToAllDispatcher, Dispatcher, _all_to_all, _AllToAll


class DedupAllToAllDispatcher(Dispatcher):
    def dispatch(self, x, experts, probs, keep):
        if self.ep.size == 1:  # nothing to deduplicate: the plain path
            self._plain = AllToAllDispatcher(self.num_experts, self.ep)
            return self._plain.dispatch(x, experts, probs, keep)
        self._plain = None
        tokens, p, e = x.shape[0], self.ep.size, self.local
        chosen = torch.ones_like(experts, dtype=torch.bool) if keep is None else keep
        # dense [T, E] weights and choice mask (zero / False where not chosen or dropped)
        weights = probs.new_zeros((tokens, self.num_experts)).scatter(
            1, experts, probs * chosen.to(probs.dtype)
        )
        mask = torch.zeros((tokens, self.num_experts), dtype=torch.bool, device=x.device)
        mask.scatter_(1, experts, chosen)
        to_rank = mask.view(tokens, p, e).any(-1)  # [T, P]
        pairs = to_rank.t().nonzero()  # (rank, token), rank-major, then token order
        dest, self.token = pairs[:, 0], pairs[:, 1]
        side = torch.cat(
            [
                weights.view(tokens, p, e)[self.token, dest],
                mask.view(tokens, p, e)[self.token, dest].to(weights.dtype),
            ],
            dim=1,
        )  # [S, 2e]
        self.tokens = tokens
        self.in_splits = to_rank.sum(0).tolist()
        sizes = torch.tensor(self.in_splits, device=x.device)
        self.out_splits = _all_to_all(sizes, self.ep, [1] * p, [1] * p).tolist()
        rows = _AllToAll.apply(
            x.index_select(0, self.token), self.ep, self.out_splits, self.in_splits
        )
        side = _AllToAll.apply(side, self.ep, self.out_splits, self.in_splits)
        self.received = rows.shape[0]
        row, local = (side[:, e:] > 0.5).nonzero().unbind(1)  # row-major: source, token, expert
        order = torch.argsort(local, stable=True)
        self.row, local = row[order], local[order]
        self.weight = side[:, :e][self.row, local]
        return rows.index_select(0, self.row), torch.bincount(local, minlength=e)

    def combine(self, out):
        if self._plain is not None:
            return self._plain.combine(out)
        weighted = out * self.weight.to(out.dtype).unsqueeze(1)
        per_row = out.new_zeros((self.received, out.shape[1])).index_add(0, self.row, weighted)
        back = _AllToAll.apply(per_row, self.ep, self.in_splits, self.out_splits)
        y = out.new_zeros((self.tokens, out.shape[1])).index_add(0, self.token, back)
        self.token = self.weight = self.row = None
        return y
