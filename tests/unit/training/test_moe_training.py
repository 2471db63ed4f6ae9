"""A MoE GPT through the trainer, and MoE config errors before any training.

* a tiny Mixtral-style GPT on the default corpus (a 300 kB slice of the standard
  library's source, as configs/moe.yaml trains on), one process: the loss falls,
  the load stays reasonably even, the statistics reach the log line and
  TensorBoard, the end-of-run sample loads the gathered weights (expert biases
  included);
* bad input (num_experts % ep, top_k > num_experts, ep not dividing dp, ep on a
  dense model, expert sizes over tp) stops ``prepare`` with the numbers named;
* the aux/z-loss gradient carries the loss scale like the main loss (a static
  scale of 1024 changes nothing, with the balancing loss weighted heavily);
* configs/moe.yaml is valid for 4 ranks, and ``mtcore train configs/moe.yaml
  --nproc 4`` trains (slow).
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.data import lm_batches
from mtcore.models.gpt import GPT, GPTConfig
from mtcore.parallel.layout import ParallelLayout
from mtcore.precision import MixedPrecision
from mtcore.testing.compare import rel_error
from mtcore.training.config import ConfigError, OptimizerConfig
from mtcore.training.engine import Engine
from mtcore.training.overrides import load_config, validate
from mtcore.training.trainer import prepare, train

ROOT = Path(__file__).resolve().parents[3]
MOE = dict(num_experts=4, top_k=2, ffn_size=64)


def _config(cache: Path, tensorboard: Path | None = None, **model) -> dict:
    return {
        "model": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=64,
                      moe=MOE, **model),
        "precision": {"dtype": "fp32"},
        "data": dict(vocab_size=512, default_corpus_bytes=300_000, cache_dir=str(cache)),
        "optimizer": dict(lr=5e-3, min_lr=5e-4, warmup_steps=5),
        "training": dict(steps=30, global_batch_size=8, micro_batch_size=4, eval_interval=0,
                         eval_batches=1, sample_tokens=8),
        "checkpoint": {"dir": None},
        "logging": dict(interval=10, progress="lines",
                        tensorboard_dir=str(tensorboard) if tensorboard else None),
    }  # fmt: skip


def test_moe_gpt_trains_on_the_default_corpus(tmp_path):
    out = io.StringIO()
    config = _config(tmp_path / "cache", tmp_path / "tb", moe_layer_freq=1)
    result = train(validate(config), stream=out)
    log = out.getvalue()
    first, last = result.losses[0], sum(result.losses[-5:]) / 5
    loads = [s["load_max_mean"] for s in result.moe[-10:]]
    balance = sum(loads) / len(loads)
    print(f"loss {first:.3f} -> {last:.3f}; busiest expert / mean, last 10 steps: {balance:.2f}")
    assert not result.skipped_steps and len(result.moe) == 30
    assert last < first - 1.0, (first, last)  # ln(512) = 6.24 at the start
    assert 1.0 <= balance < 2.0, loads  # 4.0 would be one expert taking every token
    assert all(s["dropped"] == 0.0 for s in result.moe)  # dropless
    assert sum(v for k, v in result.moe[-1].items() if k.startswith("tokens_e")) == 2 * 8 * 64 * 2
    assert re.search(r"step 30/30 \| moe load max/mean [0-9.]+ .*tokens/expert \[", log), log
    assert "mixture of experts: 4 experts, top-2, in 2 of 2 layers, ep=1" in log
    assert result.sample is not None  # the one-process model loaded the gathered weights
    events = b"".join(p.read_bytes() for p in (tmp_path / "tb").glob("events.out.tfevents.*"))
    assert b"moe/load_max_mean" in events and b"moe/aux_loss" in events


@pytest.mark.parametrize(
    "model, parallel, world, message",
    [
        (dict(moe=dict(MOE, num_experts=6)), dict(ep=4), 4,
         r"num_experts=6 is not divisible by the expert-parallel size ep=4"),
        (dict(moe=dict(MOE, top_k=5)), {}, 1, r"top_k=5 is larger than num_experts=4"),
        (dict(moe=MOE), dict(ep=4, tp=2), 4, r"ep=4 must divide dp\*cp = 2\*1 = 2"),
        (dict(moe=None), dict(ep=2), 2, r"ep=2 splits mixture-of-experts layers, but this model "
         r"is dense"),
        (dict(moe=dict(MOE, ffn_size=65)), dict(tp=2), 2,
         r"expert ffn_size=65 is not divisible by tp=2"),
        (dict(moe=dict(MOE, capacity_factor=1.25)), dict(cp=2), 2,
         r"capacity_factor=1.25 with context parallel cp=2: .* use capacity_factor=None"),
    ],
)  # fmt: skip
def test_bad_moe_config_fails_before_training(tmp_path, model, parallel, world, message):
    config = _config(tmp_path / "cache")
    config["model"].update(model)
    config["parallel"] = parallel
    with pytest.raises(ConfigError, match=message):
        prepare(validate(config), world)


def test_moe_config_defaults_and_parameter_counts():
    cfg = GPTConfig(
        style="gpt2", vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, seq_len=16,
        moe_layer_freq=2, moe=dict(MOE, shared_ffn_size=32),
    )  # fmt: skip
    assert cfg.moe.activation == "gelu"  # follows the model unless set
    assert [cfg.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    # active: 2 of 4 experts per MoE layer; each expert is h*f + f*h (GELU, no bias)
    assert cfg.num_params() - cfg.num_params(active=True) == 2 * 2 * (2 * 32 * 64)
    dense = cfg.model_copy(update={"moe": None})
    assert dense.num_params(active=True) == dense.num_params()


def test_aux_loss_gradient_carries_the_loss_scale():
    cfg = GPTConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, seq_len=16, init_std=0.1,
        moe=dict(MOE, ffn_size=32, aux_loss_coeff=1.0, z_loss_coeff=0.1),
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (2, 2, 2, 16), generator=g) for _ in range(2)]
    runs = []
    for scale in (None, 1024.0):
        engine = Engine(
            cfg, ParallelLayout.single(), select_backend("cpu"), micro_batch_size=2,
            num_microbatches=2, optimizer=OptimizerConfig(lr=1e-2, warmup_steps=0),
            precision=MixedPrecision("fp32", loss_scale=scale),
        )  # fmt: skip
        steps = [engine.train_step(lm_batches(b[0], b[1])) for b in batches]
        runs.append((steps, engine.full_state_dict()))
    (plain, plain_w), (scaled, scaled_w) = runs
    for a, b in zip(plain, scaled, strict=True):
        assert not b.skipped and abs(a.grad_norm - b.grad_norm) <= 1e-6 * a.grad_norm
    for name in ("layers.0.mlp.router.weight", "layers.1.mlp.router.weight"):
        assert rel_error(scaled_w[name], plain_w[name]) <= 1e-6, name


def test_moe_yaml_is_valid_for_four_ranks():
    config = load_config(str(ROOT / "configs/moe.yaml"), [])
    spec, microbatches = config.check(4)
    assert (spec.tp, spec.dp, spec.ep, microbatches) == (2, 2, 2, 2)
    assert config.model.moe.num_experts == 8 and config.model.moe.top_k == 2
    changed = load_config(
        str(ROOT / "configs/moe.yaml"),
        ["--model.moe.top_k", "4", "--model.moe.dispatcher=allgather"],
    )
    assert (changed.model.moe.top_k, changed.model.moe.dispatcher) == (4, "allgather")
    with pytest.raises(ConfigError, match=r"model\.moe has no 'experts' \(known: num_experts"):
        load_config(str(ROOT / "configs/moe.yaml"), ["--model.moe.experts", "4"])
    with pytest.raises(ConfigError, match=r"model\.moe\.ffn_size: Field required"):
        load_config(None, ["--model.moe.num_experts", "4"])  # a dense default made MoE


@pytest.mark.slow
def test_moe_yaml_trains_on_four_ranks(tmp_path, run_mtcore):
    """The shipped job, shortened: ep=2 x tp=2 x dp=2 with ZeRO-1 through `mtcore train`."""
    args = ["train", ROOT / "configs/moe.yaml", "--nproc", "4",
            "--training.steps", "60", "--training.eval_interval", "0",
            "--training.sample_tokens", "0", "--logging.tensorboard_dir", "null",
            "--checkpoint.dir", str(tmp_path / "checkpoints"),
            "--data.cache_dir", str(tmp_path / "cache"), "--data.default_corpus_bytes", "1000000"]  # fmt: skip
    run = run_mtcore(*args, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+/60 \| loss ([0-9.]+)", run.stdout, re.M)]
    loads = [
        float(x)
        for x in re.findall(r"moe load max/mean [0-9.]+ \(layer avg ([0-9.]+)\)", run.stdout)
    ]
    print(run.stdout[-2000:])
    assert losses[-1] < losses[0] - 1.0, losses
    assert loads[-1] < 2.5, loads  # 8 experts: one expert taking all would be 8.0
