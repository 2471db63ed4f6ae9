"""mtcore's LLaVA step (ViT + projector + GPT) against a plain PyTorch loop, one process.

    .venv/bin/python benchmarks/bench_vlm.py [--rounds 6 --warmup 2] [--profile 3]
    .venv/bin/python benchmarks/bench_vlm.py --quick      # smoke test, a few seconds

The same LLaVA-style model (a CLIP-style ViT: patch embedding, class token, learned
positions, pre-LayerNorm, pre-LN blocks with quick-GELU; the ``mlp2x_gelu`` projector;
a llama-style GPT: RMSNorm, RoPE, SwiGLU, grouped-query attention, untied output;
fp32, dropout 0) trains from the same weights on the same batches (random text with
one image's ``image_tokens`` placeholder ids after the first token, random pixels;
labels ignored on the image positions and the prompt), with the same AdamW, warmup +
cosine learning rate, clipping and gradient accumulation over the micro-batches:

* ``plain torch``: ``PlainLlava`` below, as a PyTorch user writes it: ``nn.Linear``,
  ``nn.LayerNorm``, ``nn.RMSNorm``, ``F.scaled_dot_product_attention`` (bidirectional
  in the tower, causal with GQA in the language model), the image features put in with
  ``masked_scatter``, ``F.cross_entropy`` summed over the step's target tokens;
  ``torch.optim.AdamW`` and ``clip_grad_norm_``. The language model's blocks are
  bench_trainer.py's ``PlainBlock``;
* ``mtcore``: the trainer's ``Engine`` step (``mtcore.models.vlm.Llava``) on the ``cpu``
  backend as shipped (reference kernels);
* ``mtcore+native``: the same on a backend that also registers the torch-native kernels
  plain torch calls (SDPA, ``F.rms_norm``, ``F.silu`` SwiGLU, torch's fused AdamW,
  ``F.layer_norm``, ``F.cross_entropy``): the same kernels on both sides.

Each of the three runs twice: with every part trained, and with the vision tower frozen
(LLaVA's stage 2; ``model.freeze: [vision]``; the plain loop sets ``requires_grad``
off and runs the tower under ``no_grad``, as mtcore does). All six take turns round by
round; per freeze setting the report gives median step time, image tokens per second,
the ratio of medians and the median per-round ratio to plain torch (target: <= 1.0).

**Memory per process** (one process is one rank here): parameter bytes, gradient bytes
(plain: ``.grad`` after a backward; mtcore: the fp32 gradient buffers), optimizer state
bytes (measured from the optimizer's tensors after a step) and the bytes of the
tensors autograd saves for the backward of one micro-batch (``saved_tensors_hooks``,
each storage counted once, parameters' storages left out).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F
from _loops import check_same_loss, native_backend, one_process_engine, plain_adamw, plain_step
from _timing import Timings, alternate, load_average, report
from bench_bert import NATIVE_EXTRA
from bench_trainer import PlainBlock
from torch import nn

from mtcore.backend import select_backend
from mtcore.models.common.decoder.model import IGNORE_INDEX
from mtcore.models.vlm.config import LlavaConfig
from mtcore.ops import rope_tables
from mtcore.training.config import OptimizerConfig

OPT = OptimizerConfig(
    lr=1e-3, min_lr=1e-4, betas=(0.9, 0.999), eps=1e-8, warmup_steps=5, weight_decay=0.01,
    max_grad_norm=1.0,
)  # fmt: skip
TOTAL_STEPS = 300
IMAGE_ID, PROMPT = 1, 4  # the placeholder id; text tokens after the image with no label


def model_config(quick: bool, freeze: tuple[str, ...]) -> LlavaConfig:
    """64 px images in 8 px patches (64 image tokens) through a 4-layer ViT of width 128,
    a GPT of 4 layers, width 256, over 128 positions (the 64 image tokens included)."""
    if quick:
        vision = dict(image_size=32, patch_size=8, hidden_size=64, num_layers=2, num_heads=4)
        lm = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=32)
    else:
        vision = dict(image_size=64, patch_size=8, hidden_size=128, num_layers=4, num_heads=4)
        lm = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, seq_len=128)
    return LlavaConfig(vocab_size=4096, vision=vision, freeze=freeze, **lm)


class PlainViTBlock(nn.Module):
    def __init__(self, h: int, f: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.LayerNorm(h, eps), nn.LayerNorm(h, eps)
        self.attn = nn.Module()
        self.attn.qkv, self.attn.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (
            t.view(b, s, self.heads, -1).transpose(1, 2)
            for t in self.attn.qkv(self.attn_norm(x)).chunk(3, -1)
        )
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.attn.proj(y.transpose(1, 2).reshape(b, s, h))
        u = self.mlp.fc1(self.mlp_norm(x))
        return x + self.mlp.fc2(u * torch.sigmoid(1.702 * u))  # quick-GELU


class PlainViT(nn.Module):
    """CLIP's vision tower as LLaVA uses it; the class token is dropped at the end."""

    def __init__(self, config: LlavaConfig):
        super().__init__()
        v, h = config.vision, config.vision.hidden_size
        self.p = v.patch_size
        self.embed = nn.Module()
        self.embed.weight = nn.Parameter(torch.empty(h, v.channels * self.p**2))
        self.embed.cls = nn.Parameter(torch.empty(h))
        self.embed.pos = nn.Parameter(torch.empty(v.seq_len, h))
        self.pre_norm = nn.LayerNorm(h, v.norm_eps)
        self.layers = nn.ModuleList(
            PlainViTBlock(h, v.ffn_size, v.num_heads, v.norm_eps) for _ in range(v.num_layers)
        )

    def forward(self, pixels):
        n, ch, height, width = pixels.shape
        p = self.p
        patches = pixels.reshape(n, ch, height // p, p, width // p, p).permute(0, 2, 4, 1, 3, 5)
        x = F.linear(patches.reshape(n, -1, ch * p * p), self.embed.weight)
        x = torch.cat([self.embed.cls.expand(n, 1, -1), x], dim=1) + self.embed.pos
        x = self.pre_norm(x)
        for block in self.layers:
            x = block(x)
        return x[:, 1:]


class PlainLlava(nn.Module):
    """ViT, ``mlp2x_gelu`` projector, llama-style GPT; parameter names are mtcore's."""

    def __init__(self, c: LlavaConfig):
        super().__init__()
        self.freeze_vision = c.frozen("vision")
        self.vision = PlainViT(c)
        self.projector = nn.Module()
        self.projector.fc1 = nn.Linear(c.vision.hidden_size, c.hidden_size)
        self.projector.fc2 = nn.Linear(c.hidden_size, c.hidden_size)
        self.embed = nn.Module()
        self.embed.tok = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(PlainBlock(c) for _ in range(c.num_layers))
        self.norm = nn.RMSNorm(c.hidden_size, c.norm_eps)
        self.output = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.cos, self.sin = rope_tables(c.seq_len, c.head_dim, c.rope_theta)

    def forward(self, batch):
        pixels = batch["pixel_values"]
        with torch.no_grad() if self.freeze_vision else contextlib.nullcontext():
            features = self.vision(pixels.flatten(0, 1))
        features = self.projector.fc2(F.gelu(self.projector.fc1(features)))
        x = self.embed.tok(batch["tokens"])
        x = x.masked_scatter(batch["image_mask"].unsqueeze(-1), features)
        for block in self.layers:
            x = block(x, self.cos, self.sin)
        return self.output(self.norm(x))

    def loss(self, batch, count):
        """This micro-batch's summed cross-entropy over the step's target tokens."""
        logits = self(batch)
        total = F.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX,
            reduction="sum",
        )  # fmt: skip
        return total / count


class PlainLoop:
    def __init__(self, config: LlavaConfig, weights: dict[str, torch.Tensor]):
        self.model = PlainLlava(config)
        self.model.load_state_dict(weights, strict=True)
        if config.frozen("vision"):
            self.model.vision.requires_grad_(False)
        self.opt = plain_adamw(self.model, OPT)

    def step(self, step: int, batches: list[dict]) -> float:
        count = sum((b["labels"] != IGNORE_INDEX).sum() for b in batches)
        losses = (self.model.loss(batch, count) for batch in batches)
        return plain_step(
            self.model, self.opt, OPT.lr_at(step, TOTAL_STEPS), OPT.max_grad_norm, losses
        )

    def first_loss(self, batch: dict) -> torch.Tensor:
        return self.model.loss(batch, (batch["labels"] != IGNORE_INDEX).sum())

    def memory(self) -> dict[str, int]:
        params = list(self.model.parameters())
        return {
            "params": sum(p.nbytes for p in params),
            "grads": sum(p.nbytes for p in params if p.requires_grad),
            "optimizer": sum(
                t.nbytes for s in self.opt.state.values() for t in s.values() if t.dim() > 0
            ),
        }


class MtcoreLoop:
    def __init__(self, config: LlavaConfig, backend, micro: int, microbatches: int):
        self.engine = one_process_engine(config, backend, micro, microbatches, OPT)
        self.model = self.engine.chunks[0]

    def step(self, step: int, batches: list[dict]) -> float:
        self.engine.set_lr(OPT.lr_at(step, TOTAL_STEPS))
        return self.engine.train_step(batches).loss

    def first_loss(self, batch: dict) -> torch.Tensor:
        ((total, count),) = self.model.loss(self.model.stage({}, batch), batch).values()
        return total / count

    def memory(self) -> dict[str, int]:
        state = self.engine.optimizer.state_tensors()
        return {
            "params": sum(p.nbytes for p in self.model.parameters()),
            "grads": sum(buf.grad.nbytes for buf in self.engine.ddp.grad_buffers),
            "optimizer": sum(t.nbytes for ts in state.values() for t in ts),
        }


def saved_activation_bytes(loop, batch: dict) -> int:
    """Bytes autograd keeps for the backward of one micro-batch's loss: each saved
    tensor's storage once, parameters' storages (weights saved for the matmuls, mtcore's
    flat parameter buffers) left out."""
    params = {p.untyped_storage().data_ptr() for p in loop.model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loop.first_loss(batch)
    del loss
    return sum(storages.values())


def make_batches(config: LlavaConfig, steps: int, micro: int, microbatches: int, seed: int = 0):
    """``steps`` lists of ``microbatches`` micro-batches: a random first token, one
    image's ``image_tokens`` placeholders, random text; labels are the next token,
    ignored on the image positions and the ``PROMPT`` tokens after them."""
    s, n, v = config.seq_len, config.image_tokens, config.vocab_size
    images = config.images.max_images
    size = config.vision.image_size
    g = torch.Generator().manual_seed(seed)

    def batch():
        ids = torch.randint(IMAGE_ID + 1, v, (micro, s + 1), generator=g)
        ids[:, 1 : 1 + n] = IMAGE_ID
        tokens, labels = ids[:, :-1].clone(), ids[:, 1:].clone()
        labels[:, : n + PROMPT] = IGNORE_INDEX
        pixels = torch.randn(micro, images, 3, size, size, generator=g)
        return {
            "tokens": tokens, "labels": labels, "image_mask": tokens == IMAGE_ID,
            "pixel_values": pixels,
        }  # fmt: skip

    return [[batch() for _ in range(microbatches)] for _ in range(steps)]


def subset(timings: Timings, names: list[str]) -> Timings:
    return Timings({n: timings.rounds[n] for n in names}, {n: timings.final_loss[n] for n in names})


def print_memory(loops: dict, batch: dict) -> None:
    mib = 2**20
    print("\nmemory per process (MiB; activations: one micro-batch's saved tensors)")
    print("| configuration | params | grads | optimizer | activations | total |")
    print("|---|---|---|---|---|---|")
    for name, loop in loops.items():
        mem = loop.memory() | {"activations": saved_activation_bytes(loop, batch)}
        cells = " | ".join(
            f"{mem[k] / mib:.2f}" for k in ("params", "grads", "optimizer", "activations")
        )
        print(f"| {name} | {cells} | {sum(mem.values()) / mib:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--profile", type=int, default=0, help="steps per loop under torch.profiler"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.warmup = 2, 1
    torch.set_num_threads(args.threads)
    print(f"load at start: {load_average()}")
    micro, m = args.micro_batch, args.microbatches
    batches = make_batches(model_config(args.quick, ()), args.warmup + args.rounds, micro, m)
    loops, groups = {}, {}
    for label, freeze in (("", ()), (" frozen", ("vision",))):
        config = model_config(args.quick, freeze)
        mine = {
            f"mtcore{label}": MtcoreLoop(config, select_backend("cpu"), micro, m),
            f"mtcore+native{label}": MtcoreLoop(config, native_backend(NATIVE_EXTRA), micro, m),
        }
        weights = {
            n: p.detach().clone() for n, p in mine[f"mtcore{label}"].model.named_parameters()
        }
        mine = {f"plain torch{label}": PlainLoop(config, weights), **mine}
        with torch.no_grad():  # the same loss from the same weights: the same math
            losses = {n: loop.first_loss(batches[0][0]).item() for n, loop in mine.items()}
        check_same_loss(losses, f"plain torch{label}", rtol=1e-5)
        loops |= mine
        groups[f"plain torch{label}"] = list(mine)
    print(model_config(args.quick, ()).describe())

    def step(loop):
        return lambda i: loop.step(i + 1, batches[i])

    timings = alternate({n: step(loop) for n, loop in loops.items()}, args.rounds, 1, args.warmup)
    image_tokens = micro * m * config.images.max_images * config.image_tokens
    print(
        f"\nfp32, {micro} x {m} samples/step, {image_tokens} image tokens + "
        f"{micro * m * (config.seq_len - config.image_tokens)} text positions per step, "
        f"{args.threads} thread(s), {args.rounds} rounds after {args.warmup} warm-up; "
        "'tokens/s' is image tokens per second"
    )
    for baseline, names in groups.items():
        print(f"\nvision tower {'frozen' if 'frozen' in baseline else 'trained'}:")
        report(subset(timings, names), baseline, image_tokens)
    print_memory(loops, batches[0][0])
    if args.profile:
        profile_ops({n: loops[n] for n in ("plain torch", "mtcore+native")}, batches, args.profile)


def profile_ops(loops: dict, batches: list, steps: int, top: int = 10) -> None:
    """Each loop's ``steps`` steps under ``torch.profiler`` (the loops in turn, twice):
    total self CPU ms and the ``top`` ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    print(f"\nself CPU ms over {steps} steps (torch.profiler; each loop twice, in turn)")
    for rep in range(2):
        for name, loop in loops.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for i in range(steps):
                    loop.step(i + 1, batches[i % len(batches)])
            events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            total = sum(e.self_cpu_time_total for e in events) / 1e3
            ops = ", ".join(f"{e.key} {e.self_cpu_time_total / 1e3:.0f}" for e in events[:top])
            print(f"{name} ({rep + 1}): total {total:.0f}; {ops}")
    print(f"load at end: {load_average()}")


if __name__ == "__main__":
    main()
