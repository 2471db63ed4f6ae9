"""configs/deepseek.yaml: a small DeepSeek-style GPT (latent attention, a dense first
layer, shared and group-limited routed experts) resolves for 4 ranks; trained two steps
in one process, its checkpoint generates and exports to transformers' DeepSeek-V3; and
(slow) it trains through `mtcore train` on 4 CPU ranks with a falling loss.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch

from mtcore.cli.main import main
from mtcore.plan import load_hardware, plan
from mtcore.training.checkpoint import load_model
from mtcore.training.overrides import load_config
from mtcore.training.trainer import train

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


def test_a_trained_deepseek_checkpoint_generates_and_exports(tmp_path, corpus, data_cache, capsys):
    """Issue 47: configs/deepseek.yaml's model (a dense first layer, then MoE) trained two
    steps in one process; its checkpoint loads (``load_model``), generates through
    `mtcore generate` and exports through `mtcore convert to-hf` to a directory that
    transformers' DeepseekV3ForCausalLM loads with the checkpoint's logits."""
    transformers = pytest.importorskip("transformers")
    overrides = ["--parallel.tp", "1", "--parallel.ep", "1", "--parallel.zero1", "false",
                 "--training.steps", "2", "--training.global_batch_size", "2",
                 "--training.micro_batch_size", "2", "--training.eval_interval", "0",
                 "--training.sample_tokens", "0", "--logging.tensorboard_dir", "null",
                 "--model.seq_len", "32", "--data.paths", str(corpus), "--data.vocab_size", "300",
                 "--data.cache_dir", str(data_cache), "--checkpoint.dir", str(tmp_path / "ck")]  # fmt: skip
    config = load_config(CONFIG, overrides)
    assert config.model.first_dense_layers == 1 and config.model.num_moe_layers == 3
    trained = train(config, stream=io.StringIO())
    model, step, _ = load_model(trained.checkpoint)
    assert step == 2 and "layers.0.mlp.fc1.weight" in model.state_dict()

    capsys.readouterr()
    assert (
        main(["generate", str(tmp_path / "ck"), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    )
    assert capsys.readouterr().out.startswith("def ")

    out = tmp_path / "hf"
    assert main(["convert", "to-hf", str(tmp_path / "ck"), str(out), "--dtype", "fp32"]) == 0
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager"
    )
    assert type(hf).__name__ == "DeepseekV3ForCausalLM" and not any(info.values()), info
    tokens = torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(tokens).logits, model(tokens), atol=1e-4, rtol=1e-4)
