"""``mtcore convert megatron-args``: a Megatron-LM launch script (tests/data/megatron,
written as MT-MegatronLM's examples are) or inline arguments become an mtcore config
that ``load_config`` accepts, and every argument left out is named on stderr."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtcore.cli.main import main
from mtcore.training.overrides import load_config

SCRIPT = Path(__file__).resolve().parents[2] / "data" / "megatron" / "run_llama2_7b.sh"


def _convert(source: str, capsys, tmp_path):
    code = main(["convert", "megatron-args", source])
    captured = capsys.readouterr()
    if code != 0:
        return code, None, captured.err
    path = tmp_path / "from_megatron.yaml"
    path.write_text(captured.out)
    return code, load_config(path), captured.err


def test_a_launch_script_becomes_a_config_that_validates(capsys, tmp_path):
    code, config, err = _convert(str(SCRIPT), capsys, tmp_path)
    assert code == 0, err
    model = config.model
    assert (model.num_layers, model.hidden_size, model.num_heads, model.ffn_size) == (
        32,
        4096,
        32,
        11008,
    )
    assert (model.norm, model.activation, model.position, model.tie_embeddings, model.bias) == (
        "rmsnorm", "swiglu", "rope", False, False)  # fmt: skip
    assert model.seq_len == config.data.seq_len == 4096
    parallel = config.parallel
    assert (parallel.tp, parallel.pp, parallel.sequence_parallel, parallel.zero1) == (
        2,
        2,
        True,
        True,
    )
    assert (config.training.global_batch_size, config.training.micro_batch_size) == (64, 1)
    assert (config.training.steps, config.training.seed) == (250000, 42)
    assert (config.optimizer.lr, config.optimizer.min_lr, config.optimizer.warmup_steps) == (
        3e-4,
        3e-5,
        2000,
    )
    assert config.optimizer.betas == (0.9, 0.95) and config.optimizer.schedule == "cosine"
    assert config.precision.dtype == "bf16"
    assert config.checkpoint.dir == "/data/checkpoints/llama2_7b"
    assert config.logging.tensorboard_dir == "/data/checkpoints/llama2_7b/tensorboard"
    assert config.data.paths == ["/data/llama2/wudao_text_document"]
    named = {line.split(": ")[2].split()[0] for line in err.splitlines()}
    assert named == {
        "--use-flash-attn",
        "--transformer-impl",
        "--tokenizer-type",
        "--tokenizer-model",
        "--split",
        "--load",
    }
    assert "mtcore convert from-megatron" in err  # what to do with a Megatron checkpoint


def test_inline_arguments_gqa_moe_and_refusals(capsys, tmp_path):
    inline = ("--num-layers 4 --hidden-size 64 --num-attention-heads 8 --group-query-attention "
              "--num-query-groups 2 --swiglu --disable-bias-linear --position-embedding-type rope "
              "--seq-length 128 --max-position-embeddings 128 --num-experts 8 --moe-router-topk 2 "
              "--moe-ffn-hidden-size 32 --expert-model-parallel-size 2 --frobnicate 3")  # fmt: skip
    code, config, err = _convert(inline, capsys, tmp_path)
    assert code == 0, err
    assert config.model.kv_heads == 2 and config.parallel.ep == 2
    assert (config.model.moe.num_experts, config.model.moe.top_k, config.model.moe.ffn_size) == (
        8,
        2,
        32,
    )
    assert config.model.moe.topk_then_softmax
    assert err == "mtcore convert megatron-args: not mapped: --frobnicate 3: no mtcore setting\n"
    code, _, err = _convert(inline + " --qk-layernorm", capsys, tmp_path)
    assert code == 2 and err.count("\n") == 1 and "--qk-layernorm" in err, err


def test_the_walkthrough_config_is_what_the_command_prints(capsys):
    """docs/migrating-from-megatron.md trains docs/examples/megatron/gpt_tiny.yaml, the
    conversion of run_gpt_tiny.sh beside it: the two must not drift apart."""
    example = Path(__file__).resolve().parents[3] / "docs" / "examples" / "megatron"
    assert main(["convert", "megatron-args", str(example / "run_gpt_tiny.sh")]) == 0
    assert capsys.readouterr().out == (example / "gpt_tiny.yaml").read_text()


def test_deepseek_and_qwen3_options_are_refused_both_ways(capsys, tmp_path):
    """Export names each DeepSeek/Qwen3 option it cannot write; import refuses the
    Megatron flags of group-limited routing, a routed scale and MTP in one line."""
    from mtcore.models.gpt import GPTConfig
    from mtcore.models.gpt.megatron.args import MegatronError, megatron_args

    sizes = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, seq_len=16)
    mla = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    moe = dict(num_experts=4, top_k=2, ffn_size=16)
    for options, named in (
        (dict(mla=mla), "mla"),
        (dict(qk_norm=True, num_kv_heads=2), "qk_norm"),
        (dict(mtp=dict(depth=1)), "mtp"),
        (dict(moe=moe, first_dense_layers=1), "first_dense_layers"),
        (dict(moe={**moe, "expert_groups": 2, "top_groups": 1}), "group-limited"),
        (dict(moe={**moe, "routed_scale": 2.0}), "routed_scale"),
    ):
        with pytest.raises(MegatronError, match=named):
            megatron_args(GPTConfig(**sizes, **options))
    inline = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    for flag in ("--moe-router-num-groups 2", "--moe-router-topk-scaling-factor 2.5",
                 "--mtp-num-layers 1"):  # fmt: skip
        code, _, err = _convert(inline + flag, capsys, tmp_path)
        assert code == 2 and err.count("\n") == 1 and flag.split()[0] in err, err


def test_arguments_without_a_sequence_length_are_refused_in_one_line(capsys, tmp_path):
    """Megatron-LM requires --max-position-embeddings; with neither it nor --seq-length
    the command says so in one line (it raised a TypeError traceback), exit 2."""
    sizes = "--num-layers 2 --hidden-size 32 --num-attention-heads 4"
    for extra, named in (
        (" --position-embedding-type rope", "neither --seq-length nor --max-position-embeddings"),
        ("", "no --max-position-embeddings"),
        (" --seq-length 16", "no --max-position-embeddings"),  # learned positions need it
    ):
        code, _, err = _convert(sizes + extra, capsys, tmp_path)
        assert code == 2 and err.count("\n") == 1 and named in err, err
        assert "Traceback" not in err
    code, config, err = _convert(sizes + " --position-embedding-type rope --seq-length 16",
                                 capsys, tmp_path)  # fmt: skip
    assert code == 0 and config.model.seq_len == 16, err


def test_swiglu_without_ffn_hidden_size_takes_megatron_lms_default(capsys, tmp_path):
    """Megatron-LM's validate_args sizes a SwiGLU MLP int(4h * 2/3 / 64) * 64 when
    --ffn-hidden-size is absent (4h otherwise); the config must say the same."""
    sizes = "--num-layers 2 --hidden-size 512 --num-attention-heads 4 --max-position-embeddings 16"
    code, config, err = _convert(sizes + " --swiglu", capsys, tmp_path)
    assert code == 0 and config.model.ffn_hidden_size == 1344, err  # 1365.3 -> 21 x 64
    code, config, err = _convert(sizes, capsys, tmp_path)
    assert code == 0 and config.model.ffn_hidden_size == 2048, err
