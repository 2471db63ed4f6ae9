"""`mtcore data prepare` against Megatron's preprocessing, on the same jsonl and tokenizer.

    .venv/bin/pip install -c constraints.txt -r benchmarks/requirements-megatron.txt
    .venv/bin/python benchmarks/bench_data_prepare.py [--mb 200 --workers 1 2 --rounds 2]

The corpus: ``--mb`` megabytes of jsonl (one ``{"text": ...}`` line per document)
written from this interpreter's standard library sources, the files in a new shuffled
order on each pass until the size is reached (``--workdir``, kept between runs). The
tokenizer: mtcore's byte-level BPE (vocabulary 8192, the data config's default) trained
on the same sources, cached as the trainer caches it; Megatron reads the same
``tokenizer.json`` as a HuggingFace tokenizer directory (``PreTrainedTokenizerFast``,
``<|endoftext|>`` as its end of document, special-token text split like mtcore's).

* **mtcore**: ``mtcore data prepare CORPUS --tokenizer tokenizer.json --output PREFIX
  --workers N``, as a user runs it (one process per run, progress on stderr).
* **Megatron**: what Megatron-LM's ``tools/preprocess_data.py`` does with one partition
  and ``--append-eod``, written here against Megatron-Core 0.16.1 (Megatron-LM itself is
  not installed; ``megatron-core`` is never a dependency of mtcore): a
  ``multiprocessing.Pool`` of N workers, each building Megatron-Core's
  ``HuggingFaceTokenizer`` once, ``imap`` over the file's lines in chunks of 32, each
  line ``json.loads`` -> ``tokenizer(text).input_ids`` + the end-of-document id; the main
  process adds each document to Megatron-Core's ``IndexedDatasetBuilder`` (dtype
  ``DType.optimal_dtype``) and finalizes the ``.idx``. One process per run too.

Each (side, workers) runs ``--rounds`` times, the two sides alternating and the first
side rotating from round to round. Reported: wall seconds of the run (process start to
exit: what a user waits), input MB/s and tokens/s, their median over rounds, and mtcore's
throughput over Megatron's. Then the read-back: Megatron's output through Megatron-Core's
``IndexedDataset`` and mtcore's through mtcore's ``IndexedDataset`` must hold the same
documents, token for token (and mtcore's reader must read Megatron's output the same).
``uptime`` before and after every run.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _timing import load_average

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 8192
CHUNK = 32  # preprocess_data.py's imap chunk size


# -- the inputs ---------------------------------------------------------------------------
def write_corpus(path: Path, megabytes: int) -> int:
    """jsonl of at least ``megabytes`` MB from the standard library's sources; its size."""
    from mtcore.data.corpus import stdlib_files

    want = megabytes * 1_000_000
    if path.exists() and path.stat().st_size >= want:
        return path.stat().st_size
    texts = [f.read_text(errors="replace") for f in stdlib_files(max_bytes=None)]
    rng = random.Random(0)
    tmp = path.with_suffix(".tmp")
    written = 0
    with open(tmp, "w") as out:
        while written < want:
            rng.shuffle(texts)
            for text in texts:
                line = json.dumps({"text": text}) + "\n"
                out.write(line)
                written += len(line.encode())
                if written >= want:
                    break
    tmp.replace(path)
    return path.stat().st_size


def tokenizer_files(workdir: Path) -> tuple[Path, Path]:
    """mtcore's tokenizer.json, and a HuggingFace directory holding the same tokenizer."""
    from mtcore.data import default_cache_dir
    from mtcore.data.corpus import stdlib_files
    from mtcore.data.tokenizer import EOD_TOKEN, get_tokenizer

    tok = get_tokenizer(stdlib_files(max_bytes=None), default_cache_dir(), VOCAB)
    hf_dir = workdir / "hf-tokenizer"
    hf_dir.mkdir(exist_ok=True)
    shutil.copy(tok.path, hf_dir / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD_TOKEN,
              "split_special_tokens": True, "model_max_length": 1 << 30}  # fmt: skip
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return Path(tok.path), hf_dir


# -- Megatron's side (run in its own process: --megatron) ---------------------------------
class MegatronEncoder:
    """preprocess_data.py's Encoder: one tokenizer per worker, one json line per call."""

    tokenizer = None

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir

    def initializer(self) -> None:
        from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import (
            HuggingFaceTokenizer,
        )

        MegatronEncoder.tokenizer = HuggingFaceTokenizer(
            self.hf_dir, use_fast=True, include_special_tokens=True
        )

    def encode(self, line: str):
        text = json.loads(line)["text"]
        ids = MegatronEncoder.tokenizer.text_to_ids(text)
        if not ids:
            return [], [], len(line)
        ids.append(MegatronEncoder.tokenizer.eod)
        return ids, [len(ids)], len(line)


def megatron_preprocess(corpus: str, hf_dir: str, prefix: str, workers: int) -> dict:
    import multiprocessing

    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    encoder = MegatronEncoder(hf_dir)
    encoder.initializer()
    dtype = DType.optimal_dtype(MegatronEncoder.tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    start, docs, tokens, nbytes = time.perf_counter(), 0, 0, 0
    with open(corpus, encoding="utf-8") as lines:
        pool = multiprocessing.Pool(workers, initializer=encoder.initializer)
        for ids, lengths, size in pool.imap(encoder.encode, lines, CHUNK):
            nbytes += size
            if ids:
                builder.add_document(ids, lengths)
                docs, tokens = docs + 1, tokens + len(ids)
            if docs % 10000 == 0:
                s = time.perf_counter() - start
                print(f"Processed {docs} documents ({docs / s:.1f} docs/s, "
                      f"{nbytes / s / 1e6:.1f} MB/s).", file=sys.stderr, flush=True)  # fmt: skip
        pool.close()
        pool.join()
    builder.finalize(prefix + ".idx")
    return {"documents": docs, "tokens": tokens}


# -- one run of one side --------------------------------------------------------------------
def run_side(side: str, workers: int, corpus: Path, tok: Path, hf_dir: Path, out: Path) -> dict:
    prefix = out / f"{side}-{workers}"
    for suffix in (".bin", ".idx", ".json"):
        Path(f"{prefix}{suffix}").unlink(missing_ok=True)
    if side == "mtcore":
        cmd = [str(ROOT / ".venv/bin/mtcore"), "data", "prepare", str(corpus), "--tokenizer",
               str(tok), "--output", str(prefix), "--workers", str(workers)]  # fmt: skip
    else:
        cmd = [sys.executable, __file__, "--megatron", str(corpus), str(hf_dir), str(prefix),
               str(workers)]  # fmt: skip
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    seconds = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"{side} failed ({run.returncode}):\n{run.stderr[-3000:]}")
    tokens = int(Path(f"{prefix}.bin").stat().st_size // (2 if VOCAB < 65500 else 4))
    progress = [line for line in run.stderr.splitlines() if "ETA" in line or "MB/s" in line]
    return {"seconds": seconds, "tokens": tokens, "prefix": prefix, "progress": progress[-2:]}


def read_back(mtcore_prefix: Path, megatron_prefix: Path) -> str:
    """Both outputs, each through its own reader (and Megatron's through mtcore's reader
    of Megatron's format, ``MegatronIndexedDataset``):
    the same documents, token for token."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset

    from mtcore.data.indexed import IndexedDataset
    from mtcore.data.megatron import MegatronIndexedDataset

    theirs = MegatronDataset(str(megatron_prefix))
    ours = IndexedDataset(mtcore_prefix)
    ours_on_theirs = MegatronIndexedDataset(megatron_prefix, VOCAB)
    their_docs = len(theirs.document_indices) - 1
    assert their_docs == len(ours) == len(ours_on_theirs), (their_docs, len(ours))
    their_tokens = np.concatenate([theirs[i] for i in range(len(theirs))])
    our_tokens = np.asarray(ours.tokens)
    assert np.array_equal(their_tokens, our_tokens), "token streams differ"
    assert np.array_equal(np.asarray(ours_on_theirs.tokens), our_tokens)
    return f"{their_docs:,} documents, {len(our_tokens):,} tokens: equal"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--megatron":
        corpus, hf_dir, prefix, workers = sys.argv[2:6]
        print(json.dumps(megatron_preprocess(corpus, hf_dir, prefix, int(workers))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mb", type=int, default=200, help="corpus size in MB (>= 200 for the issue)"
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/mtcore-bench-prepare"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    corpus = args.workdir / f"corpus-{args.mb}mb.jsonl"
    size = write_corpus(corpus, args.mb)
    tok, hf_dir = tokenizer_files(args.workdir)
    print(f"corpus {corpus}: {size / 1e6:.1f} MB; tokenizer {tok} (vocab {VOCAB})")
    print(f"load at start: {load_average()}")
    results: dict[tuple[str, int], list[dict]] = {}
    sides = ["mtcore", "megatron"]
    for workers in args.workers:
        for r in range(args.rounds):
            for side in sides[r % 2 :] + sides[: r % 2]:
                res = run_side(side, workers, corpus, tok, hf_dir, args.workdir)
                results.setdefault((side, workers), []).append(res)
                print(f"{side:<8} workers {workers} round {r + 1}: {res['seconds']:.1f} s, "
                      f"{size / res['seconds'] / 1e6:.2f} MB/s, "
                      f"{res['tokens'] / res['seconds']:,.0f} tokens/s | {load_average()}",
                      flush=True)  # fmt: skip
                for line in res["progress"]:
                    print(f"    {line}")
        check = read_back(results[("mtcore", workers)][-1]["prefix"],
                          results[("megatron", workers)][-1]["prefix"])  # fmt: skip
        print(f"read back, workers {workers}: {check}")
    print(f"load at end: {load_average()}")
    print(
        "\n| side | workers | seconds (median) | MB/s | tokens/s | mtcore / megatron throughput |"
    )
    print("|---|---|---|---|---|---|")
    for workers in args.workers:
        med = {s: statistics.median(r["seconds"] for r in results[(s, workers)]) for s in sides}
        for side in sides:
            tokens = results[(side, workers)][-1]["tokens"]
            ratio = f"{med['megatron'] / med['mtcore']:.2f}" if side == "mtcore" else ""
            print(f"| {side} | {workers} | {med[side]:.1f} | {size / med[side] / 1e6:.2f} | "
                  f"{tokens / med[side]:,.0f} | {ratio} |")  # fmt: skip


if __name__ == "__main__":
    main()
