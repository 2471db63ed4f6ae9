"""`mtcore data prepare`: every input kind gives the trainer's own tokens, with workers,
re-runs that do nothing, resumption after a failure, and the command's output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mtcore.cli.main import main
from mtcore.data import DataConfig, DataError, build_datasets
from mtcore.data.corpus import find_files
from mtcore.data.indexed import IndexedDataset, get_indexed_dataset
from mtcore.data.prepare import prepare_data


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """24 documents of a few lines each (one line break inside, no blank lines)."""
    rng = np.random.default_rng(7)
    words = ["alpha", "beta", "gamma", "tensor", "shard", "rank", "token", "def", "return"]
    return [
        "\n".join(" ".join(rng.choice(words, 6)) for _ in range(4)) + f" {i}" for i in range(24)
    ]


@pytest.fixture(scope="module")
def tokenizer_json(trained) -> Path:
    return trained[0].path


def trainer_tokens(path: Path, tokenizer, cache: Path, **kw) -> np.ndarray:
    """The tokens the trainer's own path (its cached index) gives ``path``."""
    return np.asarray(get_indexed_dataset(find_files(path), tokenizer, cache, "t", **kw).tokens)


def prepared_tokens(path: Path, tokenizer_json: Path, out: Path, **kw) -> np.ndarray:
    done = prepare_data([path], tokenizer_json, out, **kw)
    assert not done.up_to_date and done.documents > 0
    return np.asarray(IndexedDataset(out).tokens)


def test_text_file_documents_split_at_blank_lines(tmp_path, trained, tokenizer_json, docs):
    tok = trained[0]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n  \n".join(docs))  # a blank line may hold spaces
    expected = np.concatenate([np.append(tok.encode(d), tok.eod_id) for d in docs])
    got = prepared_tokens(path, tokenizer_json, tmp_path / "out" / "txt")
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got, trainer_tokens(path, tok, tmp_path / "cache"))
    assert len(IndexedDataset(tmp_path / "out" / "txt")) == len(docs)
    # A separator of one's own, and one document per file.
    path.write_text("\n%%\n".join(docs))
    sep = prepare_data([path], tokenizer_json, tmp_path / "sep", txt_separator="\n%%\n")
    assert sep.documents == len(docs)
    whole = prepare_data([path], tokenizer_json, tmp_path / "whole", txt_separator=None)
    assert whole.documents == 1


def test_jsonl_with_workers_matches_the_trainer(tmp_path, trained, tokenizer_json, docs):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    one = prepared_tokens(path, tokenizer_json, tmp_path / "one", text_key="body")
    two = prepared_tokens(path, tokenizer_json, tmp_path / "two", text_key="body", workers=2)
    np.testing.assert_array_equal(one, two)
    np.testing.assert_array_equal(
        one, trainer_tokens(path, trained[0], tmp_path / "cache", text_key="body")
    )


def test_parquet_matches_the_trainer(tmp_path, trained, tokenizer_json, docs):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), path, row_group_size=5)
    got = prepared_tokens(path, tokenizer_json, tmp_path / "pq")
    np.testing.assert_array_equal(got, trainer_tokens(path, trained[0], tmp_path / "cache"))
    with pytest.raises(DataError, match=r"no column 'body' \(columns: text, id\)"):
        prepare_data([path], tokenizer_json, tmp_path / "bad", text_key="body")


def test_datasets_save_to_disk_directory_matches_the_trainer(
    tmp_path, trained, tokenizer_json, docs
):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "hf"
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(path), max_shard_size="2KB")
    assert len(list(path.glob("*.arrow"))) > 1  # several shards, read in order
    got = prepared_tokens(path, tokenizer_json, tmp_path / "ds")
    np.testing.assert_array_equal(got, trainer_tokens(path, trained[0], tmp_path / "cache"))
    tok = trained[0]
    expected = np.concatenate([np.append(tok.encode(d), tok.eod_id) for d in docs])
    np.testing.assert_array_equal(got, expected)


def test_rerun_does_nothing_and_changed_inputs_replace_the_output(tmp_path, tokenizer_json, docs):
    path = tmp_path / "c.txt"
    path.write_text("\n\n".join(docs))
    out = tmp_path / "out"
    first = prepare_data([path], tokenizer_json, out)
    mtime = (tmp_path / "out.bin").stat().st_mtime_ns
    again = prepare_data([path], tokenizer_json, out)
    assert again.up_to_date and again.documents == first.documents == len(docs)
    assert (tmp_path / "out.bin").stat().st_mtime_ns == mtime
    path.write_text("\n\n".join(docs[:5]))
    changed = prepare_data([path], tokenizer_json, out)
    assert not changed.up_to_date and changed.documents == 5  # replaced, not appended
    assert len(IndexedDataset(out)) == 5


def test_an_interrupted_run_resumes_with_the_files_done(tmp_path, tokenizer_json, docs, capsys):
    from mtcore.data.progress import report_to

    good, bad = tmp_path / "in" / "a.jsonl", tmp_path / "in" / "b.jsonl"
    good.parent.mkdir()
    good.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    bad.write_text('{"text": "fi"}\n{"text"  "ne"}\n')  # line 2 lacks its colon
    with pytest.raises(DataError, match=r"b\.jsonl:2: invalid JSON"):
        prepare_data([good.parent], tokenizer_json, tmp_path / "out")
    parts = list(tmp_path.glob("out.parts-*"))
    assert len(parts) == 1 and (parts[0] / "part-000000.idx").is_file()
    assert not (tmp_path / "out.idx").exists()  # no output until every file is done
    committed = (parts[0] / "part-000000.bin").stat().st_mtime_ns
    # Repair the file in place (same size and mtime: the same inputs), then run again.
    st = bad.stat()
    bad.write_text('{"text": "fi"}\n{"text": "ne"}\n')
    os.utime(bad, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (parts[0] / "part-000000.bin").stat().st_mtime_ns == committed
    report_to(sys.stderr)
    try:
        resumed = prepare_data([good.parent], tokenizer_json, tmp_path / "out")
    finally:
        report_to(None)
    assert "resumed; 1 of 2 input file(s) were already done" in capsys.readouterr().err
    assert resumed.documents == len(docs) + 2
    assert not list(tmp_path.glob("out.parts-*"))  # joined, then removed
    fresh = prepare_data([good.parent], tokenizer_json, tmp_path / "fresh")
    np.testing.assert_array_equal(
        np.asarray(IndexedDataset(tmp_path / "out").tokens),
        np.asarray(IndexedDataset(fresh.prefix).tokens),
    )


def test_command_prints_progress_and_summary_and_trains(tmp_path, tokenizer_json, docs, capsys):
    path = tmp_path / "c.txt"
    path.write_text("\n\n".join(docs))
    mtcore = Path(sys.executable).with_name("mtcore")
    cmd = [str(mtcore), "data", "prepare", str(path), "--tokenizer", str(tokenizer_json),
           "--output", str(tmp_path / "p"), "--workers", "2"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert f"{len(docs)} documents" in run.stdout and "written in" in run.stdout
    assert f"prepare p: {len(docs)} documents" in run.stderr  # the summary line
    # Again, in-process: nothing to do; and a missing input is exit 2 (bad input) naming it.
    assert main(cmd[1:]) == 0
    out, err = capsys.readouterr()
    assert "up to date" in out and "nothing to do" in err
    data = build_datasets(
        DataConfig(paths=[str(tmp_path / "p")], tokenizer=str(tokenizer_json), seq_len=16)
    )
    assert data.train.num_docs + data.valid.num_docs == len(docs)
    assert main([*cmd[1:3], str(tmp_path / "nope.txt"), *cmd[4:]]) == 2
    assert "mtcore data prepare: error: data path does not exist" in capsys.readouterr().err


def test_bad_inputs_and_outputs_are_one_line_exit_2_and_write_nothing(
    tmp_path, tokenizer_json, capsys
):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "fine"}\n')
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("first line\nna\xefve caf\xe9\n".encode("latin-1"))
    jsonl = tmp_path / "bytes.jsonl"
    jsonl.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    cases = [
        ([str(good)], a_file / "sub" / "out", f"is under {a_file}, which is a file"),
        ([str(good)], tmp_path / "missing" / "out", "does not exist; create it first"),
        ([str(good)], tmp_path, "is a directory; give a file prefix inside it"),
        ([str(latin1)], tmp_path / "o1", f"{latin1}:2: not UTF-8 (byte 0xef at column 3)"),
        ([str(jsonl)], tmp_path / "o2", f"{jsonl}:2: not UTF-8 (byte 0xff at column 11)"),
        ([str(tmp_path / "nope.txt")], tmp_path / "o3", "data path does not exist"),
    ]
    for inputs, output, said in cases:
        argv = [
            "data",
            "prepare",
            *inputs,
            "--tokenizer",
            str(tokenizer_json),
            "--output",
            str(output),
        ]
        assert main(argv) == 2, said
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("mtcore data prepare: error:") and said in err[-1], err
    assert not (tmp_path / "missing").exists()
    assert not list(tmp_path.glob("o*.bin")) and not list(tmp_path.glob("o*.idx"))


def test_a_full_disk_is_exit_1_and_the_next_run_goes_on(tmp_path, tokenizer_json, docs, capsys):
    """Root only: a tiny tmpfs that the output does not fit in."""
    disk = tmp_path / "disk"
    disk.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                          capture_output=True)  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()}")
    try:
        corpus = tmp_path / "big.txt"
        corpus.write_text("\n\n".join(docs * 40))
        argv = ["data", "prepare", str(corpus), "--tokenizer", str(tokenizer_json),
                "--output", str(disk / "out"), "--workers", "1"]  # fmt: skip
        assert main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"mtcore data prepare: error: writing {disk / 'out'}: No space left")
        assert "run the same command again" in err
        assert not (disk / "out.idx").exists() and not (disk / "out.json").exists()
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_damaged_part_is_tokenized_again_not_reused(tmp_path, tokenizer_json, docs, capsys):
    """A part an interrupted run finished, whose tokens were cut short since (a disk that
    lost them): the next run says so and tokenizes that file again, and the output equals
    a fresh run's (it used to be joined as it was, and the joined output refused)."""
    from mtcore.data.progress import report_to

    good, bad = tmp_path / "in" / "a.jsonl", tmp_path / "in" / "b.jsonl"
    good.parent.mkdir()
    good.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    bad.write_text('{"text": "fi"}\n{"text"  "ne"}\n')
    with pytest.raises(DataError):
        prepare_data([good.parent], tokenizer_json, tmp_path / "out")
    (parts,) = tmp_path.glob("out.parts-*")
    tokens = parts / "part-000000.bin"
    tokens.write_bytes(tokens.read_bytes()[:-6])  # three tokens lost
    st = bad.stat()
    bad.write_text('{"text": "fi"}\n{"text": "ne"}\n')
    os.utime(bad, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same inputs: parts are reused
    report_to(sys.stderr)
    try:
        prepare_data([good.parent], tokenizer_json, tmp_path / "out")
    finally:
        report_to(None)
    err = capsys.readouterr().err
    assert f"{parts / 'part-000000'}: its tokens hold" in err and f"tokenizing {good} again" in err
    assert "resumed" not in err  # nothing was reused
    fresh = prepare_data([good.parent], tokenizer_json, tmp_path / "fresh")
    np.testing.assert_array_equal(
        np.asarray(IndexedDataset(tmp_path / "out").tokens),
        np.asarray(IndexedDataset(fresh.prefix).tokens),
    )


def test_the_progress_line_has_the_rate_and_the_time_left(monkeypatch):
    from mtcore.data import progress as module
    from mtcore.data.progress import Progress

    clock = [100.0]
    monkeypatch.setattr(module.time, "perf_counter", lambda: clock[0])
    progress = Progress("prepare x", total_bytes=4_000_000)
    clock[0] += 10.0  # 1 MB and 50,000 tokens in 10 s
    progress.update(docs=7, tokens=50_000, nbytes=1_000_000)
    line = progress.line()
    assert line.startswith("prepare x:  25.0% | 7 documents, 50,000 tokens | 0.1 MB/s, "), line
    assert ", 5,000 tokens/s | 10 s, ETA 30 s" in line, line  # 3 MB left at 0.1 MB/s
    unsized = Progress("prepare y")
    assert "%" not in unsized.line() and "ETA" not in unsized.line()


def test_without_a_tokenizer_the_configs_own_is_used_said_and_written_beside(
    tmp_path, trained, capsys
):
    """A new user has no tokenizer.json: `data prepare` takes the tokenizer `mtcore train`
    trains for the config (the same cached file), says where it came from and where its
    copy went, and the printed train command names that copy."""
    import yaml

    from mtcore.data.tokenizer import load_tokenizer

    docs, cache = trained[1], tmp_path / "cache"
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"data": {"paths": [str(docs)], "vocab_size": 300,
                                               "cache_dir": str(cache)}}))  # fmt: skip
    out = tmp_path / "corpus"
    assert main(["data", "prepare", str(docs), "--output", str(out), "--config", str(config)]) == 0
    captured = capsys.readouterr()
    written = tmp_path / "corpus.tokenizer.json"
    cached = build_datasets(DataConfig(paths=[str(docs)], vocab_size=300, cache_dir=str(cache)))
    assert f"tokenizer: the 300-token BPE `mtcore train` trains for {config}" in captured.err
    assert f"cached at {cached.tokenizer.path}" in captured.err  # what training itself uses
    assert f"tokenizer written to {written}" in captured.err
    assert f"--data.paths {out} --data.tokenizer {written}" in captured.out
    assert load_tokenizer(written).fingerprint == cached.tokenizer.fingerprint
    tokens = np.asarray(IndexedDataset(out).tokens)
    assert tokens.size > 0 and int(tokens.max()) < 300
    # Bad input stays one line and writes nothing: a config that is not there, both flags.
    for extra in (
        ["--config", str(tmp_path / "nope.yaml")],
        ["--config", str(config), "--tokenizer", str(written)],
    ):
        assert main(["data", "prepare", str(docs), "--output", str(tmp_path / "x"), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err, err
    assert not list(tmp_path.glob("x*"))
