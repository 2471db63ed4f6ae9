"""configs/deepseek.yaml: a small DeepSeek-style GPT (latent attention, a dense first
layer, shared and group-limited routed experts) resolves for 4 ranks, and (slow) trains
through `mtcore train` on 4 CPU ranks with a falling loss.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mtcore.plan import load_hardware, plan
from mtcore.training.overrides import load_config

ROOT = Path(__file__).resolve().parents[3]
CONFIG = str(ROOT / "configs/deepseek.yaml")


def test_deepseek_yaml_is_valid_for_four_ranks():
    config = load_config(CONFIG, [])
    spec, microbatches = config.check(4)
    assert (spec.tp, spec.dp, spec.ep, microbatches) == (2, 2, 2, 2)
    model = config.model
    assert model.mla.q_lora_rank == 64 and model.mla.qk_head_dim == 48
    assert not model.is_moe_layer(0) and all(model.is_moe_layer(i) for i in (1, 2, 3))
    assert (model.moe.score, model.moe.expert_groups, model.moe.top_groups) == ("sigmoid", 4, 2)
    plain = load_config(CONFIG, ["--model.mla.q_lora_rank", "null"])
    assert plain.model.mla.q_lora_rank is None
    # The planner models latent attention (tests/unit/plan/test_latent_plan.py).
    planned = plan(config, 4, load_hardware("H100-SXM"))
    assert any("latent attention: a generation KV cache" in note for note in planned.notes)


@pytest.mark.slow
def test_deepseek_yaml_trains_on_four_ranks(tmp_path, run_mtcore):
    """The shipped job, shortened: tp=2 x dp=2, experts over ep=2, ZeRO-1."""
    args = ["train", CONFIG, "--nproc", "4",
            "--training.steps", "60", "--training.eval_interval", "0",
            "--training.sample_tokens", "0", "--logging.tensorboard_dir", "null",
            "--checkpoint.dir", str(tmp_path / "checkpoints"),
            "--data.cache_dir", str(tmp_path / "cache"), "--data.default_corpus_bytes", "1000000"]  # fmt: skip
    run = run_mtcore(*args, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+/60 \| loss ([0-9.]+)", run.stdout, re.M)]
    print(run.stdout[-2000:])
    assert losses[-1] < losses[0] - 1.0, losses
