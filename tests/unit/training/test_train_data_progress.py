"""`mtcore train`'s first run says what it prepares (tokenizer, token index) while it does."""

from __future__ import annotations

import yaml

from mtcore.cli.main import main


def test_first_run_reports_tokenizer_and_index_progress(tmp_path, capsys):
    corpus = tmp_path / "docs"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"d{i}.py").write_text(
            "".join(f"def f{i}_{j}(x):\n    return x + {j}\n" for j in range(40))
        )
    config = {
        "model": dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=32),
        "precision": {"dtype": "fp32"},
        "data": dict(paths=[str(corpus)], vocab_size=300, cache_dir=str(tmp_path / "cache")),
        "training": dict(steps=1, global_batch_size=4, micro_batch_size=4, eval_interval=0,
                         sample_tokens=0),
        "checkpoint": {"dir": None},
        "logging": dict(tensorboard_dir=None, progress="lines"),
    }  # fmt: skip
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0
    err = capsys.readouterr().err
    assert "training a 300-token byte-level BPE on 6 file(s) (once; cached)" in err
    assert "tokenizing docs: 6 documents" in err  # the index build's summary line
    assert main(["train", str(path)]) == 0  # cached: nothing to report
    assert "tokenizing" not in capsys.readouterr().err
