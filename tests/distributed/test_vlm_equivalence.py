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
trains) under pp2. Context parallel: cp2 (ring), cp2 x tp2 with sp, and cp2 x pp2
(all-gather), with the vision tower replicated on every cp rank.

Some samples carry two images and some none (``_batches``), so the image slots, the
order of images within a sample and unused slots are all exercised.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mtcore.data import DataConfig
from mtcore.models import family_of
from mtcore.models.vlm import LlavaConfig
from mtcore.testing.equivalence import Case, Setup, assert_matches, spawn
from mtcore.training.config import OptimizerConfig

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
CASES = {
    "tp2": Case(2, "base", dict(tp=2)),
    "tp2_sp": Case(2, "no_cls", dict(tp=2, sequence_parallel=True)),
    "pp2": Case(2, "base", dict(pp=2)),
    "dp2_zero1_frozen": Case(2, "frozen", dict(dp=2), zero1=True),
    "tp2_pp2": Case(4, "base", dict(tp=2, pp=2)),
    "pp2_stage1": Case(2, "stage1", dict(pp=2)),  # stage 1's rank trains nothing
    "pp2_vpp2": Case(2, "base", dict(pp=2, vpp=2)),
    "tp2_dp2_full": Case(4, "full", dict(tp=2, dp=2)),  # recompute: the tower's blocks too
    # context parallel: images straddle the cp ranks' chunks (``test_images_straddle_...``)
    "cp2": Case(2, "base", dict(cp=2)),
    "cp2_tp2_sp": Case(4, "base", dict(cp=2, tp=2, sequence_parallel=True)),
    "cp2_pp2": Case(4, "base", dict(cp=2, pp=2, cp_method="allgather")),
}


@functools.cache
def _model(name: str) -> tuple[LlavaConfig, object]:
    config = MODELS[name]()
    data = family_of(config).data(DataConfig(), config)
    return config.with_vocab(data.tokenizer.vocab_size), data


def _optimizer_state(engine, record: dict) -> None:
    record["state_numel"] = sum(t.numel() for t in engine.optimizer._state["exp_avg"])


@functools.cache
def _setup() -> Setup:
    models = {name: _model(name)[0] for name in MODELS}
    return Setup(models, OPT, batch_size=BATCH, micro_batch_size=MB, seed=5,
                 initial_weights=True, probe=_optimizer_state)  # fmt: skip


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


@pytest.fixture(scope="module")
def runs():
    return spawn(_setup(), CASES, {model: _batches(model) for model in MODELS})


@pytest.mark.parametrize("case", list(CASES))
def test_vlm_layout_matches_one_process(runs, case):
    names = {"loss", "lm", "caption_accuracy"}
    assert_matches(_setup(), case, CASES[case], *runs[case], eval_names=names)


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


def test_images_straddle_the_cp_ranks():
    """Under cp2 the 56 positions are four chunks of 14 and an image takes 17: some image
    has positions on both cp ranks, so its features are placed by global number."""
    from mtcore.parallel.context import local_positions

    ranks = [set(local_positions(SEQ, 2, r).tolist()) for r in range(2)]
    mask = _batches("base")[0]["image_mask"]
    straddling = 0
    for row in mask:
        held = set(row.nonzero()[:, 0].tolist())
        straddling += all(held & r for r in ranks)
    assert straddling > 0
