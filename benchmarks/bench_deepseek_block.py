"""One DeepSeek-style block (latent attention + shared and grouped routed experts),
mtcore's against a plain PyTorch one, forward + backward, one process, side by side.

    .venv/bin/python benchmarks/bench_deepseek_block.py [--rounds 20 --tokens 1024]
    .venv/bin/python benchmarks/bench_deepseek_block.py --quick      # a few seconds

* ``plain torch``: ``PlainBlock`` below, as a PyTorch user writes it: ``nn.Linear``,
  ``nn.RMSNorm``, rotate-half RoPE, ``F.scaled_dot_product_attention`` (queries and
  keys of 48 dims, values of 32, the scale given), sigmoid router with DeepSeek-V3's
  group-limited top-k, a loop over the experts with ``index_add_``;
* ``mtcore``: ``mtcore.models.common.decoder.model.Block`` of a GPT config with
  ``mla`` and ``moe`` on the ``cpu`` backend (kernels as shipped: the reference
  attention, grouped matmul, RMSNorm), one process.

Both hold the same weights (the plain block's are copied from mtcore's) and the
script first checks that the outputs and input gradients agree, then alternates
rounds (``benchmarks/_timing.py``) and prints the medians, the ratio of medians and
the median per-round ratio with ``uptime``'s load. It also prints the per-token
cache of latent attention against per-head keys and values.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from _timing import alternate, load_average
from torch import nn

from mtcore.backend import select_backend
from mtcore.models.common.decoder.model import Block
from mtcore.models.common.decoder.rope import gpt_rope_tables
from mtcore.models.gpt import GPTConfig, single_context

HIDDEN, HEADS = 256, 8
MLA = dict(
    q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32
)
MOE = dict(num_experts=16, top_k=4, ffn_size=128, shared_ffn_size=256, score="sigmoid",
           expert_groups=4, top_groups=2, routed_scale=2.5, aux_loss="none")  # fmt: skip


class PlainBlock(nn.Module):
    def __init__(self, h, heads, m, e, eps):
        super().__init__()
        self.heads, self.m, self.e = heads, m, e
        qk = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
        self.attn_norm, self.mlp_norm = nn.RMSNorm(h, eps=eps), nn.RMSNorm(h, eps=eps)
        self.q_a = nn.Linear(h, m["q_lora_rank"], bias=False)
        self.q_norm = nn.RMSNorm(m["q_lora_rank"], eps=1e-6)
        self.q_b = nn.Linear(m["q_lora_rank"], heads * qk, bias=False)
        self.kv_a = nn.Linear(h, m["kv_lora_rank"] + m["qk_rope_head_dim"], bias=False)
        self.kv_norm = nn.RMSNorm(m["kv_lora_rank"], eps=1e-6)
        self.kv_b = nn.Linear(
            m["kv_lora_rank"], heads * (m["qk_nope_head_dim"] + m["v_head_dim"]), bias=False
        )
        self.o = nn.Linear(heads * m["v_head_dim"], h, bias=False)
        self.gate = nn.Linear(h, e["num_experts"], bias=False)
        self.gate_up = nn.Parameter(torch.empty(e["num_experts"], 2 * e["ffn_size"], h))
        self.down = nn.Parameter(torch.empty(e["num_experts"], h, e["ffn_size"]))
        self.shared_gate_up = nn.Linear(h, 2 * e["shared_ffn_size"], bias=False)
        self.shared_down = nn.Linear(e["shared_ffn_size"], h, bias=False)
        self.scale = qk**-0.5

    @staticmethod
    def rotate(x, cos, sin):  # x [b, s, heads, d]
        x1, x2 = x.chunk(2, -1)
        c, s = cos[:, None], sin[:, None]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    def attention(self, x, cos, sin):
        m, b, s = self.m, x.shape[0], x.shape[1]
        nope, rope, v_dim = m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"]
        q = self.q_b(self.q_norm(self.q_a(x))).view(b, s, self.heads, nope + rope)
        latent, k_rope = self.kv_a(x).split([m["kv_lora_rank"], rope], -1)
        kv = self.kv_b(self.kv_norm(latent)).view(b, s, self.heads, nope + v_dim)
        k_nope, v = kv.split([nope, v_dim], -1)
        q = torch.cat([q[..., :nope], self.rotate(q[..., nope:], cos, sin)], -1)
        k_rope = self.rotate(k_rope[:, :, None], cos, sin).expand(b, s, self.heads, rope)
        k = torch.cat([k_nope, k_rope], -1)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=self.scale,
        )
        return self.o(y.transpose(1, 2).reshape(b, s, -1))

    def experts(self, x):
        e, flat = self.e, x.reshape(-1, x.shape[-1])
        scores = torch.sigmoid(self.gate(flat).float())
        groups = scores.view(len(flat), e["expert_groups"], -1)
        best = groups.topk(2, -1).values.sum(-1).topk(e["top_groups"], -1).indices
        keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
        chooser = groups.masked_fill(~keep[..., None], float("-inf")).view_as(scores)
        chosen = chooser.topk(e["top_k"], -1).indices
        weights = scores.gather(-1, chosen)
        weights = e["routed_scale"] * weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for expert in range(e["num_experts"]):
            token, slot = torch.where(chosen == expert)
            if len(token):
                gate, up = F.linear(flat[token], self.gate_up[expert]).chunk(2, -1)
                y = F.linear(F.silu(gate) * up, self.down[expert])
                out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
        gate, up = self.shared_gate_up(flat).chunk(2, -1)
        return (out + self.shared_down(F.silu(gate) * up)).view_as(x)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attn_norm(x), cos, sin)
        return x + self.experts(self.mlp_norm(x))


def copy_weights(plain: PlainBlock, mine: dict) -> None:
    names = {
        "attn_norm.weight": "attn_norm.weight", "mlp_norm.weight": "mlp_norm.weight",
        "q_a.weight": "attn.q_down.weight", "q_norm.weight": "attn.q_norm.weight",
        "q_b.weight": "attn.q_up.weight", "kv_a.weight": "attn.kv_down.weight",
        "kv_norm.weight": "attn.kv_norm.weight", "kv_b.weight": "attn.kv_up.weight",
        "o.weight": "attn.proj.weight", "gate.weight": "mlp.router.weight",
        "shared_gate_up.weight": "mlp.shared.fc1.weight", "shared_down.weight": "mlp.shared.fc2.weight",
    }  # fmt: skip
    state = {p: mine[m] for p, m in names.items()}
    state["gate_up"] = mine["mlp.experts.fc1"].transpose(1, 2)
    state["down"] = mine["mlp.experts.fc2"].transpose(1, 2)
    plain.load_state_dict(state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=1024, help="sequence length (batch 2)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds, seq = (3, 128) if args.quick else (args.rounds, args.tokens)
    config = GPTConfig(vocab_size=128, hidden_size=HIDDEN, num_layers=2, num_heads=HEADS,
                       seq_len=seq, init_std=0.05, mla=MLA, moe=MOE)  # fmt: skip
    mine = Block(single_context(config, select_backend("cpu")), 1)
    plain = PlainBlock(HIDDEN, HEADS, MLA, MOE, config.norm_eps)
    copy_weights(plain, mine.state_dict())
    cos, sin = gpt_rope_tables(config)
    x = torch.randn(2, seq, HIDDEN, generator=torch.Generator().manual_seed(0))

    def run(which):
        inp = x.clone().requires_grad_()
        out = mine(inp, (cos, sin)) if which == "mtcore" else plain(inp, cos, sin)
        out.square().mean().backward()
        return out, inp.grad

    (a, ga), (b, gb) = run("mtcore"), run("plain torch")
    print(
        f"max |out diff| {(a - b).abs().max():.2e}, max |input grad diff| {(ga - gb).abs().max():.2e}"
    )
    assert torch.allclose(a, b, atol=1e-4) and torch.allclose(ga, gb, atol=1e-5)
    steps = {name: (lambda i, n=name: run(n)[0].sum().item()) for name in ("plain torch", "mtcore")}
    timings = alternate(steps, rounds=rounds, warmup=2)
    medians = {n: statistics.median(timings.steps(n)) for n in steps}
    paired = statistics.median(
        m[0] / p[0]
        for m, p in zip(timings.rounds["mtcore"], timings.rounds["plain torch"], strict=True)
    )
    print(
        f"batch 2 x {seq} tokens, hidden {HIDDEN}, {HEADS} heads, {rounds} rounds; {load_average()}"
    )
    for name, t in medians.items():
        print(f"  {name:12s} median {t * 1e3:8.1f} ms per forward + backward")
    print(f"  mtcore / plain: ratio of medians {medians['mtcore'] / medians['plain torch']:.2f}, "
          f"median per-round ratio {paired:.2f}")  # fmt: skip
    per_token = config.mla.cache_values_per_token()
    mha = HEADS * (config.mla.qk_head_dim + config.mla.v_head_dim)
    print(f"cache per token and layer: latent {per_token} numbers, per-head k and v {mha} "
          f"({mha / per_token:.1f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
