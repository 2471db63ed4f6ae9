"""``mtcore convert to-megatron / from-megatron`` without Megatron-Core: the legacy files
round-trip mtcore weights exactly at any tp x pp, torch_dist ones too (dense models),
and bad input fails in one line with exit 2 (Megatron-Core itself loads and writes them
in tests/distributed/test_megatron_checkpoints.py and test_megatron_lm_checkpoint.py)."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from mtcore.cli.main import main
from mtcore.models.gpt import GPTConfig, full_weight_shapes
from mtcore.training.checkpoint import read_model_weights, write_model_weights
from mtcore.training.checkpoint.megatron import (
    read_megatron,
    write_megatron_legacy,
    write_megatron_torch_dist,
)

CONFIGS = {
    "gpt2_tied_learned": GPTConfig(style="gpt2", vocab_size=64, hidden_size=32, num_layers=4,
                                   num_heads=4, seq_len=8, gelu_approximate="none"),
    "llama_gqa_moe": GPTConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4,
                               num_kv_heads=2, seq_len=8, moe_layer_freq=2,
                               moe=dict(num_experts=4, top_k=2, ffn_size=16, topk_then_softmax=True)),
}  # fmt: skip


def _weights(config: GPTConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weights = {
        name: torch.randn(shape, generator=g) for name, shape in full_weight_shapes(config).items()
    }
    for name in weights:
        if name.endswith("router.expert_bias"):
            weights[name].zero_()
    return weights


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 4)])
def test_legacy_files_round_trip_the_weights_exactly(tmp_path, name, tp, pp):
    config, weights = CONFIGS[name], _weights(CONFIGS[name])
    directory = write_megatron_legacy(config, weights, tmp_path, tp=tp, pp=pp, iteration=5)
    expected = {
        f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp)
    }
    assert {d.name for d in directory.iterdir()} == expected
    again, imported, iteration = read_megatron(tmp_path)
    assert iteration == 5
    assert again.structure() == config.structure()
    assert again.gelu_approximate == config.gelu_approximate
    assert imported.keys() == weights.keys()
    for key in weights:
        assert torch.equal(imported[key], weights[key]), key


DENSE = {
    "gpt2_tied_learned": CONFIGS["gpt2_tied_learned"],
    "llama_gqa_untied": GPTConfig(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4,
                                  num_kv_heads=2, seq_len=8, qkv_bias=True),
}  # fmt: skip


@pytest.mark.parametrize("name", DENSE)
def test_torch_dist_files_round_trip_the_weights_exactly(tmp_path, name):
    config, weights = DENSE[name], _weights(DENSE[name])
    directory = write_megatron_torch_dist(config, weights, tmp_path, iteration=4)
    names = {p.name for p in directory.iterdir()}
    assert {"metadata.json", "common.pt", ".metadata"} <= names
    again, imported, iteration = read_megatron(tmp_path)
    assert iteration == 4 and again.structure() == config.structure()
    assert imported.keys() == weights.keys()
    assert all(torch.equal(imported[k], weights[k]) for k in weights)


def test_torch_dist_export_of_experts_round_trips_and_mixed_layers_are_refused(tmp_path, capsys):
    """Every layer with experts: SequentialMLP's stacked [layers, experts, ...] layout
    (Megatron-Core's own load of it: tests/distributed/test_megatron_moe_dist_export.py),
    read back exactly. Dense and expert layers mixed (--moe-layer-freq 2): Megatron-Core
    numbers such layers apart, a layout not written; refused in one line, nothing written."""
    config = CONFIGS["llama_gqa_moe"].model_copy(update={"moe_layer_freq": 1})
    weights = _weights(config)
    directory = write_megatron_torch_dist(config, weights, tmp_path / "all_moe", iteration=2)
    again, imported, _ = read_megatron(directory.parent)
    assert again.structure() == config.structure() and imported.keys() == weights.keys()
    assert all(torch.equal(imported[k], weights[k]) for k in weights)
    mixed = CONFIGS["llama_gqa_moe"]
    write_model_weights(tmp_path / "ckpt", _weights(mixed), mixed)
    out = tmp_path / "meg"
    assert main(["convert", "to-megatron", str(tmp_path / "ckpt"), str(out),
                 "--format", "torch_dist"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mixing dense and expert layers" in err
    assert not out.exists() or not any(out.iterdir())


def test_cli_round_trip_and_the_arguments_it_prints(tmp_path, capsys):
    """In process (``main``, what the console script calls)."""
    config = CONFIGS["llama_gqa_moe"]
    weights = _weights(config)
    write_model_weights(tmp_path / "ckpt", weights, config, step=3)
    out = ["convert", "to-megatron", str(tmp_path / "ckpt"), str(tmp_path / "meg")]
    assert main([*out, "--tp", "2", "--pp", "2"]) == 0
    err = capsys.readouterr().err
    assert "--num-experts 4" in err and "--disable-bias-linear" in err
    assert "--group-query-attention --num-query-groups 2" in err
    assert main(["convert", "from-megatron", str(tmp_path / "meg"), str(tmp_path / "back")]) == 0
    assert "checkpoint:" in capsys.readouterr().err  # the settings that train from it
    again_config, again, step = read_model_weights(tmp_path / "back")
    assert step == 3 and again_config.structure() == config.structure()
    assert all(torch.equal(again[k], weights[k]) for k in weights)
    assert main([*out, "--tp", "2"]) == 2  # OUT_DIR holds the export now
    assert "is not an empty directory" in capsys.readouterr().err


class _Payload:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _legacy_file(root, saved) -> None:
    (root / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    torch.save(saved, root / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("1")


def test_bad_input_fails_in_one_line_with_exit_2(tmp_path, capsys):
    """In process (``main``, what the console script calls): four processes would cost
    seconds each."""
    unsupported = tmp_path / "qk_norm"
    args = argparse.Namespace(num_layers=1, hidden_size=8, num_attention_heads=2, qk_layernorm=True)
    _legacy_file(unsupported, {"args": args, "model": {}})
    hostile = tmp_path / "hostile"
    _legacy_file(hostile, {"args": _Payload(f"touch {tmp_path / 'pwned'}"), "model": {}})
    cases = {
        tmp_path / "missing": "is not a directory",
        tmp_path: "is not a Megatron checkpoint",
        unsupported: "--qk-layernorm (norms on queries and keys) is not supported",
        hostile: "refusing to unpickle posix.system",
    }
    for source, message in cases.items():
        code = main(["convert", "from-megatron", str(source), str(tmp_path / "out")])
        stderr = capsys.readouterr().err
        assert code == 2, (source, stderr)
        assert stderr.count("\n") == 1 and message in stderr, stderr
    assert not (tmp_path / "pwned").exists()
