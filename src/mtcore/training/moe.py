"""The training step's share of mixture-of-experts work, apart from the layers themselves.

``MoEStep`` (one per ``Engine``) does what only the step can know:

* ``aux_loss_scale``: the main loss of a step is the mean over micro-batches
  (each micro-batch's loss enters backward divided by their number and, under
  fp16, multiplied by the loss scale), so each layer's auxiliary/z-loss gradient
  gets the same factor: the step then minimises mean(loss + aux) as one process
  running the same micro-batches would;
* after each step: the load of every layer (tokens per expert, summed over
  the step's micro-batches and over ``dp_cp``, so equal on every rank) drives the
  auxiliary-loss-free expert bias (DeepSeek-V3), and becomes the logged load
  statistics, gathered over pipeline stages. Under context parallel each cp
  rank counts its share of every sequence, so the ``dp_cp`` sum is the load
  one process counts; its aux/z values are its contributions (``MoELayer``),
  whose mean over cp is the micro-batch's loss, so their ``dp_cp`` mean is the
  one-process mean over the step's micro-batches;
* ``gather_experts``: expert weights split over ``ep`` back into whole tensors
  under one-process names, for checkpoints and sampling.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mtcore.parallel.layout import Axis
from mtcore.parallel.moe import MoELayer, named_expert_parameters


class MoEStep:
    """The MoE layers of one rank's model chunks, and the step-level work on them.

    num_experts: the model's; a pipeline stage without MoE layers still takes
    part in the reductions over pp.
    """

    def __init__(self, chunks: list[nn.Module], layout, collective, device, num_experts: int):
        self.layers: list[MoELayer] = [
            m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)
        ]
        self.layout, self.collective, self.device = layout, collective, device
        self.num_experts = num_experts

    def set_aux_loss_scale(self, scale: float) -> None:
        """The factor of every layer's aux/z-loss gradient in the coming step."""
        for layer in self.layers:
            layer.aux_loss_scale = scale

    def discard(self) -> None:
        """Drop statistics that are not a training step's (evaluation forwards)."""
        for layer in self.layers:
            layer.pop_stats()

    @torch.no_grad()
    def finish(self, stepped: bool) -> dict[str, float]:
        """Reduce this step's statistics, update the expert biases (when ``stepped``)
        and return the load summary; collective over dp_cp and pp (call on every rank).

        Keys: ``load_max`` / ``load_min``: the busiest / idlest expert's load over the
        mean load (worst layer; 1.0 is even), ``load_max_mean``: busiest over mean,
        averaged over layers, ``dropped``: fraction of assignments dropped,
        ``aux_loss``, ``z_loss``: unweighted, mean over layers and micro-batches,
        ``tokens_e{i}``: assignments routed to expert i, summed over layers.
        """
        e = self.num_experts
        table = torch.zeros(len(self.layers), e + 3, dtype=torch.float64)
        for row, layer in zip(table, self.layers, strict=True):
            s = layer.pop_stats()
            per = 1.0 / max(s.forwards, 1)
            row[:e] = s.tokens_per_expert.double()
            row[e:] = torch.tensor([float(s.dropped), s.aux_loss * per, s.z_loss * per])
        table = table.to(self.device)
        dp = self.layout.dp_cp.size
        if dp > 1 and self.layers:
            self.collective.all_reduce(table, group=self.layout.dp_cp.group)
            # losses: mean over dp of (mean over cp of the contributions = the loss)
            table[:, e + 1 :] /= dp
        tokens = table[:, :e]
        if stepped:
            for layer, load in zip(self.layers, tokens, strict=True):
                layer.update_expert_bias(load)
        return self._summary(tokens, table[:, e:])

    def _summary(self, tokens: Tensor, extra: Tensor) -> dict[str, float]:
        """Per-stage sums and extremes, reduced over pp."""
        e = self.num_experts
        share = tokens / tokens.mean(dim=1, keepdim=True).clamp(min=1e-12)  # [layers, E]
        sums = torch.cat(
            [
                torch.tensor([len(tokens)], dtype=torch.float64, device=tokens.device),
                share.amax(dim=1).sum().reshape(1),
                extra.sum(dim=0),  # dropped, aux, z (summed over layers)
                tokens.sum(dim=0),
            ]
        )
        # max of (busiest share, -idlest share); a stage without MoE layers adds nothing.
        extremes = torch.full((2,), -float("inf"), dtype=torch.float64, device=tokens.device)
        if len(share):
            extremes = torch.stack([share.max(), -share.min()])
        if self.layout.pp > 1:
            self.collective.all_reduce(sums, group=self.layout.group(Axis.PP))
            self.collective.all_reduce(extremes, op="max", group=self.layout.group(Axis.PP))
        layers = max(float(sums[0]), 1.0)
        out = {
            "load_max": float(extremes[0]),
            "load_min": float(-extremes[1]),
            "load_max_mean": float(sums[1]) / layers,
            "dropped": float(sums[2]) / max(float(sums[5:].sum()), 1.0),
            "aux_loss": float(sums[3]) / layers,
            "z_loss": float(sums[4]) / layers,
        }
        out.update({f"tokens_e{i}": t for i, t in enumerate(sums[5 : 5 + e].tolist())})
        return out


@torch.no_grad()
def gather_experts(chunk: nn.Module, tensors: dict[str, Tensor], layout, collective) -> None:
    """Replace the expert tensors in ``tensors`` (this rank's experts, already whole over
    tp, keyed by ``chunk``'s names) by all experts, gathered over ep. Collective over ep."""
    if layout.ep == 1:
        return
    group = layout.group(Axis.EP)
    for name, _, (dim, _) in named_expert_parameters(chunk):
        mine = tensors[name].contiguous()
        out = torch.empty((layout.ep, *mine.shape), dtype=mine.dtype, device=mine.device)
        collective.all_gather(out.view(-1), mine.view(-1), group=group)
        tensors[name] = torch.cat(list(out), dim=dim)
