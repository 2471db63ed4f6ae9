"""mtcore's trainer step against a plain PyTorch training loop, one process, side by side.

    .venv/bin/python benchmarks/bench_trainer.py [--steps 20 --warmup 3 --threads 1]

Three configurations train the *same* Llama-style GPT (RMSNorm, RoPE, SwiGLU,
grouped-query attention, untied output; fp32) from the same weights on the same
batches, with the same AdamW hyper-parameters, warmup+cosine learning rate and
global-norm clipping, 2 micro-batches of gradient accumulation per step:

* ``plain torch``: ``PlainGPT`` below, written for this comparison as a user
  would (``nn.Linear``, ``F.rms_norm``, ``F.scaled_dot_product_attention``,
  ``F.cross_entropy``) with ``torch.optim.AdamW`` (torch's default on CPU) and
  ``clip_grad_norm_``;
* ``mtcore``: the trainer's ``Engine`` step (``mtcore.models.GPT`` in
  ``DataParallel`` buffers, the pipeline runner's no-pipelining schedule, mtcore
  AdamW with the inf/nan check) on the CPU backend as shipped: every kernel
  op is the reference implementation (``mtcore doctor``);
* ``mtcore+native``: the same, on a backend that also registers torch-native
  kernels (``mtcore.ops.torch_native``: SDPA attention, ``F.rms_norm``, torch's
  fused AdamW; and SwiGLU as ``F.silu(gate) * up``), as an accelerator plugin
  would: the same kernels as plain torch.

The script first checks that the three compute the same loss from the same
weights. The three alternate step by step, so load from other processes hits
them alike; reported are median step times, the ratio of medians to plain
torch and the median of per-round ratios (target: mtcore+native / plain <= 1.0).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _loops import (
    check_same_loss,
    native_backend,
    one_process_engine,
    plain_adamw,
    plain_step,
)
from _timing import alternate, load_average, report
from torch import nn

from mtcore.backend import select_backend
from mtcore.models.gpt import GPTConfig
from mtcore.ops import rope_tables
from mtcore.training.config import OptimizerConfig

MODEL = GPTConfig(
    vocab_size=8192, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, seq_len=256
)
OPT = OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=5, weight_decay=0.1, max_grad_norm=1.0)
MICRO, MICROBATCHES = 4, 2


class PlainBlock(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        h, d, f = c.hidden_size, c.head_dim, c.ffn_size
        self.heads, self.kv_heads, self.d, self.eps = c.num_heads, c.kv_heads, d, c.norm_eps
        self.attn_norm, self.mlp_norm = nn.RMSNorm(h, c.norm_eps), nn.RMSNorm(h, c.norm_eps)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(h, (c.num_heads + 2 * c.kv_heads) * d, bias=False)
        self.attn.proj = nn.Linear(c.num_heads * d, h, bias=False)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(h, 2 * f, bias=False)  # [gate | up]
        self.mlp.fc2 = nn.Linear(f, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = self.attn.qkv(self.attn_norm(x)).split(
            [self.heads * self.d, self.kv_heads * self.d, self.kv_heads * self.d], -1
        )
        q = rotate(q.view(b, s, self.heads, self.d), cos, sin).transpose(1, 2)
        k = rotate(k.view(b, s, self.kv_heads, self.d), cos, sin).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.d).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.attn.proj(y.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.mlp.fc1(self.mlp_norm(x)).chunk(2, -1)
        return x + self.mlp.fc2(F.silu(gate) * up)


def rotate(x, cos, sin):
    """Rotary embedding, rotate-half layout (as Hugging Face Llama)."""
    x1, x2 = x.chunk(2, -1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


class PlainGPT(nn.Module):
    """The same math as ``mtcore.models.GPT`` (llama style, tp=1), in plain PyTorch."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.embed = nn.Module()
        self.embed.tok = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(PlainBlock(c) for _ in range(c.num_layers))
        self.norm = nn.RMSNorm(c.hidden_size, c.norm_eps)
        self.output = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.cos, self.sin = rope_tables(c.seq_len, c.head_dim, c.rope_theta)

    def forward(self, tokens, targets):
        x = self.embed.tok(tokens)
        for block in self.layers:
            x = block(x, self.cos, self.sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class PlainLoop:
    def __init__(self, weights):
        self.model = PlainGPT(MODEL)
        self.model.load_state_dict(weights)
        self.opt = plain_adamw(self.model, OPT)

    def step(self, step, inputs, targets) -> float:
        losses = (self.model(x, y) / len(inputs) for x, y in zip(inputs, targets, strict=True))
        return plain_step(self.model, self.opt, OPT.lr_at(step, 1000), OPT.max_grad_norm, losses)


class MtcoreLoop:
    def __init__(self, backend):
        self.engine = one_process_engine(MODEL, backend, MICRO, MICROBATCHES, OPT)

    def step(self, step, inputs, targets) -> float:
        self.engine.set_lr(OPT.lr_at(step, 1000))
        batches = [{"tokens": x, "labels": y} for x, y in zip(inputs, targets, strict=True)]
        return self.engine.train_step(batches).loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    loops = {"mtcore": MtcoreLoop(select_backend("cpu")), "mtcore+native": MtcoreLoop(native_backend())}
    weights = {n: p.detach().clone() for n, p in loops["mtcore"].engine.chunks[0].named_parameters()}
    loops = {"plain torch": PlainLoop(weights), **loops}
    g = torch.Generator().manual_seed(0)
    shape = (args.warmup + args.steps, MICROBATCHES, MICRO, MODEL.seq_len)
    tokens = torch.randint(0, MODEL.vocab_size, shape, generator=g)
    targets = torch.randint(0, MODEL.vocab_size, shape, generator=g)

    with torch.no_grad():  # the same loss from the same weights: the same math
        losses = {
            name: (loop.model if name == "plain torch" else loop.engine.chunks[0])(
                tokens[0, 0], targets[0, 0]
            ).item()
            for name, loop in loops.items()
        }
    check_same_loss(losses, "plain torch", rtol=1e-5)

    print(f"load at start: {load_average()}")

    def step(loop):
        return lambda i: loop.step(i + 1, list(tokens[i]), list(targets[i]))

    steps = {name: step(loop) for name, loop in loops.items()}
    timings = alternate(steps, rounds=args.steps, warmup=args.warmup)
    tokens_per_step = MICRO * MICROBATCHES * MODEL.seq_len
    print(
        f"\nGPT {MODEL.num_params() / 1e6:.2f}M params, fp32, {tokens_per_step} tokens/step, "
        f"{args.threads} thread(s), {args.steps} steps after {args.warmup} warm-up"
    )
    report(timings, "plain torch", tokens_per_step)


if __name__ == "__main__":
    main()
