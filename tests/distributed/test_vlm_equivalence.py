"""The LLaVA family trains the same under any layout as in one process (gloo, two spawns).

Every case runs the trainer's ``Engine`` for three optimizer steps on the same global
batches of the embedded shapes task (fp32, clipping active), in micro-batches of 2,
against a one-process ``Engine`` that takes each global batch as one micro-batch: the
loss at every step, the gradient norm, every gradient of the first step (gathered
whole), the caption accuracy and the weights after the last step, relative error
<= 1e-5. Cases: tp2 (the tower's 17 tokens, class token included, stay whole under
tp), tp2 + sp with a tower without class token (its 16 tokens are sequence shards
too), pp2 (the tower on stage 0), tp2 x pp2, and dp2 with ZeRO-1 and a frozen
tower, whose weights must come out bitwise unchanged with no optimizer state; also
pp2 x vpp2, tp2 x dp2 with full recompute, and LLaVA's stage 1 (only the projector
trains) under pp2.

Some samples carry two images and some none (``_batches``), so the image slots, the
order of images within a sample and unused slots are all exercised.
"""

from __future__ import annotations

import io

import pytest
import torch

from mtcore.data import DataConfig
from mtcore.distributed import LayoutSpec, ParallelLayout
from mtcore.models import family_of
from mtcore.models.vlm import LlavaConfig
from mtcore.testing.compare import rel_error
from mtcore.testing.distributed import run_ranks
from mtcore.training.config import OptimizerConfig
from mtcore.training.engine import Engine

RTOL = 1e-5
STEPS, BATCH, MB, SEQ = 3, 8, 2, 56
VISION = dict(image_size=16, patch_size=4, hidden_size=32, num_layers=2, num_heads=4)
LM = dict(hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=SEQ, init_std=0.1)
IMAGES = dict(max_images=2, embedded_train=64, embedded_valid=0)


def _config(**changes) -> LlavaConfig:
    vision = {**VISION, **changes.pop("vision", {})}
    return LlavaConfig(vision=vision, images=IMAGES, **LM, **changes)


MODELS = {
    "base": lambda: _config(),
    "no_cls": lambda: _config(vision=dict(class_token=False)),
    "frozen": lambda: _config(freeze=("vision",)),
    "stage1": lambda: _config(freeze=("vision", "language")),  # LLaVA stage 1: the projector
    "full": lambda: _config(recompute="full"),
}
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, warmup_steps=0, max_grad_norm=0.5)
# name: (world, model, layout, zero1)
CASES = {
    "tp2": (2, "base", dict(tp=2), False),
    "tp2_sp": (2, "no_cls", dict(tp=2, sequence_parallel=True), False),
    "pp2": (2, "base", dict(pp=2), False),
    "dp2_zero1_frozen": (2, "frozen", dict(dp=2), True),
    "tp2_pp2": (4, "base", dict(tp=2, pp=2), False),
    "pp2_stage1": (2, "stage1", dict(pp=2), False),  # stage 1's rank trains nothing
    "pp2_vpp2": (2, "base", dict(pp=2, vpp=2), False),
    "tp2_dp2_full": (4, "full", dict(tp=2, dp=2), False),  # recompute: the tower's blocks too
}


def _model(name: str) -> tuple[LlavaConfig, object]:
    config = MODELS[name]()
    data = family_of(config).data(DataConfig(), config)
    return config.with_vocab(data.tokenizer.vocab_size), data


def _batches(name: str) -> list[dict[str, torch.Tensor]]:
    """STEPS global batches of the embedded task; in each, sample 1 gets a second image
    (its features placed after the first's: the answer's text moves right), sample 5
    none (its image positions become text), and sample 0 keeps one target token, so the
    two dp halves hold different numbers of targets (the token weighting matters)."""
    config, data = _model(name)
    loader = data.loader(data.train, micro_batch_size=BATCH, global_batch_size=BATCH, seed=3)
    out = []
    for _ in range(STEPS):
        b = next(loader)
        tokens, mask, labels = b["tokens"], b["image_mask"], b["labels"]
        n = config.image_tokens
        start = int(mask[1].nonzero()[0])
        for t in (tokens, labels, mask):  # a second image right after the first
            t[1, start + n :] = t[1, start : SEQ - n].clone()
        labels[1, start + n - 1 : start + 2 * n] = -100
        b["pixel_values"][1, 1] = b["pixel_values"][2, 0]
        tokens[5][mask[5]] = 7
        labels[0, (labels[0] != -100).nonzero()[1:, 0]] = -100  # dp halves: unequal counts
        mask[5] = False
        out.append(b)
    return out


def _micro(
    batch: dict[str, torch.Tensor], rows: slice, size: int = MB
) -> list[dict[str, torch.Tensor]]:
    local = {name: t[rows] for name, t in batch.items()}
    count = next(iter(local.values())).shape[0]
    return [{n: t[i : i + size] for n, t in local.items()} for i in range(0, count, size)]


def _full_grads(engine: Engine) -> dict[str, torch.Tensor] | None:
    """The reduced (and clipped) gradients, gathered whole like the weights (frozen
    parameters, which have none, report zeros)."""
    params = [p for chunk in engine.chunks for p in chunk.parameters()]
    saved = [p.data for p in params]
    for p in params:
        p.data = p.main_grad.view_as(p) if hasattr(p, "main_grad") else torch.zeros_like(p)
    try:
        return engine.full_state_dict()
    finally:
        for p, data in zip(params, saved, strict=True):
            p.data = data


def _run(engine: Engine, batches, rows: slice, grads: bool = True, size: int = MB) -> dict:
    out = {"loss": [], "norm": [], "initial": engine.full_state_dict()}
    for step, batch in enumerate(batches):
        result = engine.train_step(_micro(batch, rows, size))
        assert not result.skipped, result
        out["loss"].append(result.loss)
        out["norm"].append(result.grad_norm)
        if step == 0 and grads:
            out["grads"] = _full_grads(engine)
    out["eval"] = engine.evaluate(_micro(batches[0], rows, size))
    out["weights"] = engine.full_state_dict()
    out["state_numel"] = sum(t.numel() for t in engine.optimizer._state["exp_avg"])
    return out


def _engine(name: str, layout, backend, local: int, size: int = MB) -> Engine:
    _, model, _, zero1 = CASES[name]
    config, _ = _model(model)
    return Engine(config, layout, backend, micro_batch_size=size, num_microbatches=local // size,
                  optimizer=OPT, seed=5, zero1=zero1, bucket_size=700)  # fmt: skip


def _rank_main(ctx, names, batches):
    results = {}
    for name in names:
        world, model, layout_kw, zero1 = CASES[name]
        layout = ParallelLayout.build(
            LayoutSpec(**layout_kw), ctx.backend.collective, ctx.rank, world
        )
        dp, dp_rank = layout.size("dp"), layout.coordinate("dp")
        local = BATCH // dp
        engine = _engine(name, layout, ctx.backend, local)
        rows = slice(dp_rank * local, (dp_rank + 1) * local)
        results[name] = _run(engine, batches[model], rows, grads=not zero1)
    buf = io.BytesIO()
    torch.save(results, buf)
    return buf.getvalue()


def _reference(name: str, batches):
    from mtcore.backend import select_backend

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = _engine(name, ParallelLayout.single(), select_backend("cpu"), BATCH, BATCH)
        return _run(engine, batches, slice(None), size=BATCH)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs():
    batches = {model: _batches(model) for model in MODELS}
    out, references = {}, {}
    for world in (2, 4):
        names = [n for n, case in CASES.items() if case[0] == world]
        ranks = run_ranks(_rank_main, world, names, batches)
        ranks = [torch.load(io.BytesIO(r), weights_only=False) for r in ranks]
        for name in names:
            model = CASES[name][1]
            if model not in references:
                references[model] = _reference(name, batches[model])
            out[name] = ([r[name] for r in ranks], references[model])
    return out


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= RTOL * max(abs(want), 1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_vlm_layout_matches_one_process(runs, case):
    ranks, ref = runs[case]
    for rank, got in enumerate(ranks):
        for step in range(STEPS):
            assert _close(got["loss"][step], ref["loss"][step]), (
                case,
                rank,
                step,
                got["loss"],
                ref["loss"],
            )
            assert _close(got["norm"][step], ref["norm"][step]), (
                case,
                rank,
                step,
                got["norm"],
                ref["norm"],
            )
        assert set(got["eval"]) == {"loss", "lm", "caption_accuracy"}, got["eval"]
        for metric, value in ref["eval"].items():
            assert _close(got["eval"][metric], value), (
                case,
                rank,
                metric,
                got["eval"][metric],
                value,
            )
    for what in ("weights", "grads"):
        if what == "grads" and CASES[case][3]:
            continue  # a ZeRO-1 rank holds only its shard of the reduced gradients
        gathered = ranks[0][what]
        assert gathered is not None and set(gathered) == set(ref[what]), (case, what)
        for name, want in ref[what].items():
            err = rel_error(gathered[name], want)
            assert err <= RTOL, f"{case}: {what} {name}: rel err {err:.2e}"


def test_the_vision_tower_and_projector_learn(runs):
    """Gradients reach the tower and the projector (through the image positions), and
    clipping was active (the clipped path is what matched)."""
    _, ref = runs["tp2"]
    assert min(ref["norm"]) > OPT.max_grad_norm, ref["norm"]
    for prefix in (
        "vision.layers.0.attn.qkv.weight",
        "vision.embed.weight",
        "projector.fc1.weight",
    ):
        grads = [g for n, g in ref["grads"].items() if n.startswith(prefix)]
        assert grads and all(g.abs().sum() > 0 for g in grads), prefix


def test_a_frozen_tower_is_unchanged_and_has_no_optimizer_state(runs):
    ranks, ref = runs["dp2_zero1_frozen"]
    got = ranks[0]
    vision = [n for n in got["weights"] if n.startswith("vision.")]
    assert vision
    for name in vision:
        assert torch.equal(got["weights"][name], got["initial"][name]), name  # bitwise
    trained = [n for n in got["weights"] if not n.startswith("vision.")]
    assert any(not torch.equal(got["weights"][n], got["initial"][n]) for n in trained)
    # The optimizer's tensors over both ZeRO-1 shards: every trainable weight (each
    # buffer padded to a multiple of dp), nothing of the tower's.
    trainable = sum(got["weights"][n].numel() for n in trained)
    state = sum(r["state_numel"] for r in ranks)
    assert trainable <= state < trainable + 2 * 8, (state, trainable)
    assert ref["state_numel"] == trainable  # one process: exactly the trainable weights


def test_stage_one_trains_the_projector_alone(runs):
    """freeze: [vision, language] under pp2: the second stage holds no trainable weight
    (no gradient buffer, no optimizer state) and still runs its backward."""
    ranks, _ = runs["pp2_stage1"]
    got = ranks[0]
    for name, weight in got["weights"].items():
        changed = not torch.equal(weight, got["initial"][name])
        assert changed is name.startswith("projector."), name
    assert ranks[1]["state_numel"] == 0
