"""A checkpoint Megatron-LM itself wrote, into mtcore and back (issue 47, section 2).

``tests/data/megatron/llama_tp1/`` was written by Megatron-LM core_v0.16.1's own
``parse_args``, ``validate_args`` and ``save_checkpoint`` (torch_dist), with the logits
its Megatron-Core model gave, and a record of Megatron-LM's argument parser
(``megatron_lm_flags.json``); ``make_megatron_lm_checkpoint.py`` beside it made all
three, and says how to run it again. Megatron-LM's training package is not on the
package registry, so the suite reads these files and does not import Megatron-LM; one
test below uses Megatron-LM's parser itself where it is importable (skipped otherwise).

Checked: its ``common.pt`` (``exit_signal=signal.SIGTERM`` among 655 saved arguments)
passes the allow-listed unpickler; ``from-megatron`` gives Megatron-Core's logits
(``--norm-epsilon 1e-6``, saved as ``layernorm_epsilon``, included); the flags
``to-megatron`` prints parse with Megatron-LM's parser to the values mtcore meant
(``--rotary-base`` an int); every Megatron argument name mtcore reads or refuses is one
Megatron-LM saves, with Megatron-LM's default; the arguments that change a GPT's
arithmetic and that mtcore cannot express are refused in one line.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.cli.main import main
from mtcore.models.gpt import GPT, GPTConfig, single_context
from mtcore.models.gpt.megatron import args as megatron_args_module
from mtcore.models.gpt.megatron.args import MegatronError, model_config_from_megatron
from mtcore.training.checkpoint import load_model, read_model_weights, write_model_weights
from mtcore.training.checkpoint.safe_pickle import InertObject, torch_file
from mtcore.training.megatron_args import parse_flags, train_config_sections

FIXTURE = Path(__file__).resolve().parents[2] / "data" / "megatron" / "llama_tp1"
CHECKPOINT = FIXTURE / "checkpoint"
COMMON = CHECKPOINT / "iter_0000003" / "common.pt"
PARSER_RECORD = json.loads((FIXTURE / "megatron_lm_flags.json").read_text())


def _saved_args() -> dict:
    return vars(torch_file(COMMON)["args"])


def test_megatron_lm_s_saved_arguments_pass_the_allow_list():
    args = _saved_args()
    assert args["exit_signal"] is signal.SIGTERM and isinstance(args["exit_signal"], signal.Signals)
    assert isinstance(args["attention_backend"], InertObject)  # Megatron's own enum: data
    assert args["params_dtype"] is torch.float32
    assert len(args) > 600 and args["layernorm_epsilon"] == 1e-6  # not a hand-made Namespace


def test_a_megatron_lm_checkpoint_imports_with_megatron_core_s_logits(tmp_path, capsys):
    assert main(["convert", "from-megatron", str(CHECKPOINT), str(tmp_path / "ck")]) == 0
    config, _, step = read_model_weights(tmp_path / "ck")
    assert step == 3 and config.norm_eps == 1e-6 and config.kv_heads == 2
    assert (config.vocab_size, config.norm, config.activation) == (128, "rmsnorm", "swiglu")
    reference = torch.load(FIXTURE / "reference.pt", weights_only=True)
    model, _, _ = load_model(tmp_path / "ck")
    with torch.no_grad():
        logits = model(reference["tokens"])
    torch.testing.assert_close(logits, reference["logits"], atol=1e-5, rtol=1e-5)


# -- to-megatron's printed flags, against Megatron-LM's parser ---------------------------
_TYPES = {"int": int, "float": float, "str": str, "bool": None, None: None}


def _recorded_parser() -> argparse.ArgumentParser:
    """Megatron-LM's parser rebuilt from its record: options, attributes, actions, and
    the types int, float and str (its own converters, e.g. ``moe_freq_type``, as str)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False, add_help=False)
    for option, entry in PARSER_RECORD.items():
        kind, dest = entry["action"], entry["dest"]
        if kind in ("storetrue", "booleanoptional"):
            parser.add_argument(option, dest=dest, action="store_true")
        elif kind == "storefalse":
            parser.add_argument(option, dest=dest, action="store_false")
        elif kind == "store":
            kind_type = _TYPES.get(entry["type"], str)
            choices = entry["choices"] if kind_type in (str, None) else None
            parser.add_argument(option, dest=dest, type=kind_type, nargs=entry["nargs"],
                                choices=choices)  # fmt: skip
    return parser


def _own_converter(dest: str) -> bool:
    entries = [entry for entry in PARSER_RECORD.values() if entry["dest"] == dest]
    return any(entry["action"] == "store" and entry["type"] not in _TYPES for entry in entries)


def _parse(flags: list[str]) -> dict:
    namespace, unknown = _recorded_parser().parse_known_args(flags)
    assert not unknown, f"not Megatron-LM flags: {unknown}"
    return vars(namespace)


def _printed_flags(stderr: str) -> list[str]:
    return stderr.split("or with these model arguments:\n", 1)[1].split("\n", 1)[0].split()


GPT2 = GPTConfig(style="gpt2", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                 seq_len=8, gelu_approximate="tanh", norm_eps=1e-6)  # fmt: skip
MOE = GPTConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                seq_len=8, moe_layer_freq=2, rope_theta=500000.0,
                moe=dict(num_experts=4, top_k=2, ffn_size=16, topk_then_softmax=True,
                         aux_loss_coeff=1e-2, capacity_factor=1.5))  # fmt: skip


@pytest.mark.parametrize("name", ["megatron_lm", "gpt2", "moe"])
def test_to_megatron_prints_flags_megatron_lm_s_parser_reads_as_meant(name, tmp_path, capsys):
    if name == "megatron_lm":
        assert main(["convert", "from-megatron", str(CHECKPOINT), str(tmp_path / "ck")]) == 0
    else:
        config = GPT2 if name == "gpt2" else MOE
        weights = GPT(config, single_context(config, select_backend("cpu"))).state_dict()
        write_model_weights(tmp_path / "ck", weights, config)
    capsys.readouterr()
    assert main(["convert", "to-megatron", str(tmp_path / "ck"), str(tmp_path / "out"),
                 "--tp", "2"]) == 0  # fmt: skip
    flags = _printed_flags(capsys.readouterr().err)
    parsed = _parse(flags)
    config, _, _ = read_model_weights(tmp_path / "ck")
    meant = megatron_args_module.megatron_args(config, tp=2)
    for attribute, value in meant.items():
        if attribute in ("padded_vocab_size", "layernorm_epsilon") or value is None:
            continue
        saved_as = "layernorm_epsilon" if attribute == "norm_epsilon" else attribute
        got = parsed[saved_as]
        if _own_converter(saved_as):  # e.g. moe_freq_type: the text Megatron-LM converts
            assert got == str(value), (attribute, got, value)
            continue
        assert got == value or got == [value], (attribute, got, value)
        assert type(got[0] if isinstance(got, list) else got) is type(value), attribute
    assert parsed["layernorm_epsilon"] == config.norm_eps
    assert "--rotary-base" not in flags or type(parsed["rotary_base"]) is int


def test_the_recorded_parser_refuses_what_megatron_lm_refuses():
    """So that the test above can fail: a float base, an unknown flag."""
    with pytest.raises(argparse.ArgumentError, match=r"invalid int value: '10000\.0'"):
        _parse(["--rotary-base", "10000.0"])
    with pytest.raises(AssertionError, match="not Megatron-LM flags"):
        _parse(["--norm-eps", "1e-5"])
    with pytest.raises(MegatronError, match=r"rope_theta=1000\.5: .*--rotary-base is an integer"):
        megatron_args_module.megatron_args(MOE.model_copy(update={"rope_theta": 1000.5}))


def test_to_megatron_flags_parse_in_megatron_lm_itself(tmp_path, capsys, monkeypatch):
    """Megatron-LM's own ``parse_args`` and ``validate_args`` (where importable)."""
    with capsys.disabled():  # Megatron-Core's import enables faulthandler on sys.stderr
        arguments = pytest.importorskip("megatron.training.arguments")
    assert main(["convert", "from-megatron", str(CHECKPOINT), str(tmp_path / "ck")]) == 0
    assert main(["convert", "to-megatron", str(tmp_path / "ck"), str(tmp_path / "out")]) == 0
    flags = _printed_flags(capsys.readouterr().err)
    launch = ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
              "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
              "--transformer-impl", "local", "--no-persist-layer-norm"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags, *launch])
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    args = arguments.parse_args()
    arguments.validate_args(args, {})
    assert args.rotary_base == 10000 and args.layernorm_epsilon == 1e-6
    assert (args.num_query_groups, args.ffn_hidden_size) == (2, 64)


# -- what mtcore reads, against what Megatron-LM saves ------------------------------------
def _dests() -> dict[str, dict]:
    return {entry["dest"]: entry for entry in PARSER_RECORD.values()}


def test_every_argument_mtcore_reads_is_one_megatron_lm_saves_with_its_default():
    dests, saved = _dests(), _saved_args()
    renamed = megatron_args_module._SAVED_AS
    for name, default in megatron_args_module.MEGATRON_DEFAULTS.items():
        dest = renamed.get(name, name)
        assert dest in dests and dest in saved, name
        assert dests[dest]["default"] == default, (name, dests[dest]["default"], default)
    refused = [*megatron_args_module._UNSUPPORTED, *megatron_args_module._ONLY_DEFAULT]
    for name in refused:
        assert renamed.get(name, name) in dests, name


REFUSED = [
    *[(name, True) for name in megatron_args_module._UNSUPPORTED],
    ("layernorm_zero_centered_gamma", True),  # --apply-layernorm-1p, as 0.16 saves it
    ("softmax_type", "off-by-one"),
    ("rope_type", "yarn"),
]


@pytest.mark.parametrize("name,value", REFUSED, ids=[name for name, _ in REFUSED])
def test_arguments_that_change_the_arithmetic_are_refused_in_one_line(name, value):
    args = {**_saved_args(), name: value}
    with pytest.raises(MegatronError) as refused:
        model_config_from_megatron(args)
    message = str(refused.value)
    assert "\n" not in message and "not supported" in message
    flag = "--apply-layernorm-1p" if name == "layernorm_zero_centered_gamma" else None
    assert (flag or megatron_args_module._UNSUPPORTED.get(name, "--").split()[0]) in message
    assert model_config_from_megatron(_saved_args()).norm_eps == 1e-6  # the others pass


def test_no_position_embedding_is_a_no_op_beside_rope_and_refused_without_it():
    """Megatron-LM 0.16 (validate_args): --no-position-embedding is allowed only with
    rope, where Megatron-Core builds no position table anyway (MT-MegatronLM's
    DeepSeek scripts pass both)."""
    rope = {**_saved_args(), "add_position_embedding": False}
    assert model_config_from_megatron(rope).position == "rope"
    learned = {**rope, "position_embedding_type": "learned_absolute"}
    with pytest.raises(MegatronError, match="--no-position-embedding is not supported without"):
        model_config_from_megatron(learned)
    launch = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
              "--position-embedding-type rope --no-position-embedding")  # fmt: skip
    sections, _ = train_config_sections(parse_flags(launch.split(" ")))
    assert "position" not in sections["model"]  # rope, the llama style's default
