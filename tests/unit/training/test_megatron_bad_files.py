"""Broken Megatron checkpoints and impossible export layouts fail in one line with exit
2, naming the file or the flag, and write nothing (issue 48 section 5): real files, each
damaged the way a disk, a copy or a hand edit damages them, through ``main``."""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch

from mtcore.cli.main import main
from mtcore.models.gpt import GPTConfig, full_weight_shapes
from mtcore.training.checkpoint import write_model_weights
from mtcore.training.checkpoint.megatron import write_megatron_legacy, write_megatron_torch_dist

CONFIG = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   seq_len=8)  # fmt: skip
LATEST = "latest_checkpointed_iteration.txt"


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in full_weight_shapes(CONFIG).items()}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    write_megatron_legacy(CONFIG, _weights(), root / "legacy", tp=2, pp=1, iteration=3)
    write_megatron_torch_dist(CONFIG, _weights(), root / "dist", iteration=3)
    write_model_weights(root / "mtcore", _weights(), CONFIG, step=3)
    return root


def _copy(sources, name, tmp_path):
    shutil.copytree(sources / name, tmp_path / name)
    return tmp_path / name


def _replace_with_directory(path):
    path.unlink()
    path.mkdir()


def _half_covered(directory):
    """One tensor's chunks cover only its first half of rows: DCP would fill the rest
    with the target's zeros."""
    path = directory / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    entry = metadata.state_dict_metadata["embedding.word_embeddings.weight"]
    (chunk,) = entry.chunks
    chunk.sizes = torch.Size([chunk.sizes[0] // 2, *chunk.sizes[1:]])
    path.write_bytes(pickle.dumps(metadata))


DAMAGE = {
    "binary latest": ("legacy", lambda d: (d / LATEST).write_bytes(b"\xff\xfe\x00\x01"),
                      f"{LATEST} is not text"),
    "latest with a NUL": ("legacy", lambda d: (d / LATEST).write_bytes(b"3\x00"),
                          f"{LATEST} is not text"),
    "latest not a number": ("legacy", lambda d: (d / LATEST).write_text("abc\n"),
                            f"{LATEST} holds 'abc', not an iteration number or 'release'"),
    "latest a directory": ("legacy", lambda d: _replace_with_directory(d / LATEST),
                           f"{LATEST} is a directory where a file should be"),
    "empty iteration": ("legacy", lambda d: [shutil.rmtree(p) for p in (d / "iter_0000003").iterdir()],
                        "iter_0000003 holds no checkpoint"),
    "iteration a file": ("legacy", lambda d: (shutil.rmtree(d / "iter_0000003"),
                                              (d / "iter_0000003").write_text("")),
                         "iter_0000003 is a file, not a directory"),
    "rank file a directory": ("legacy", lambda d: _replace_with_directory(
        d / "iter_0000003" / "mp_rank_01" / "model_optim_rng.pt"),
        "mp_rank_01/model_optim_rng.pt is a directory where a file should be"),
    "rank directory a file": ("legacy", lambda d: (shutil.rmtree(d / "iter_0000003" / "mp_rank_01"),
                                                   (d / "iter_0000003" / "mp_rank_01").write_text("")),
                              "mp_rank_01 is a file where a directory should be"),
    "metadata.json not UTF-8": ("dist", lambda d: (d / "iter_0000003" / "metadata.json").write_bytes(
        b'{"sharded_backend": "\xff"}'), "metadata.json is not text"),
    "common.pt a directory": ("dist", lambda d: _replace_with_directory(
        d / "iter_0000003" / "common.pt"), "common.pt is a directory where a file should be"),
    "metadata non-UTF-8 name": ("dist", lambda d: (d / "iter_0000003" / ".metadata").write_bytes(
        (d / "iter_0000003" / ".metadata").read_bytes().replace(b"embedding", b"\xff\xfembedding", 1)),
        ".metadata is unreadable"),
    "chunks cover half a tensor": ("dist", lambda d: _half_covered(d / "iter_0000003"),
                                   "the chunks of 'embedding.word_embeddings.weight' do not cover"),
}  # fmt: skip


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_checkpoint_is_one_line_naming_the_file(sources, tmp_path, capsys, case):
    name, damage, message = DAMAGE[case]
    source = _copy(sources, name, tmp_path)
    damage(source)
    out = tmp_path / "out"
    assert main(["convert", "from-megatron", str(source), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert str(source) in err  # the file or directory is named
    assert not out.exists()


def test_impossible_export_layouts_are_refused_before_anything_is_written(
    sources, tmp_path, capsys
):
    cases = {
        ("--tp", "4"): "--tp 4: 2 key/value heads are not divisible by tp=4",
        ("--tp", "3"): "--tp 3: 4 attention heads are not divisible by tp=3",
        ("--pp", "3"): "--pp 3: 2 layers are not divisible",
        ("--tp", "abc"): "argument --tp: invalid int value: 'abc'",
    }
    for flags, message in cases.items():
        out = tmp_path / "meg"
        command = ["convert", "to-megatron", str(sources / "mtcore"), str(out), *flags]
        if "abc" in flags:  # argparse's own error, made one line
            with pytest.raises(SystemExit) as stopped:
                main(command)
            assert stopped.value.code == 2
        else:
            assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
        assert not out.exists()
    assert not list(tmp_path.iterdir())  # no hidden staging directory either
