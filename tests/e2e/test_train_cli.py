"""`mtcore train` and `mtcore generate` as a user runs them: subprocesses, real launcher.

One tiny job on 2 local ranks (pipeline parallel 2, GPT-2 style with the
embedding tied across the stages) through `mtcore train --nproc 2`, then
`mtcore generate` on its checkpoint, the same job through
`torchrun -m mtcore.train`, and bad inputs that must fail before any rank starts.
"""

from __future__ import annotations

import os
import re
import resource
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

LINE = re.compile(r"^step (\d+)/(\d+) \| loss ([0-9.]+)", re.MULTILINE)
# a log line's step, wall time (from tokens/s: s/step has 2 decimals) and all ranks' CPU
TIMES = re.compile(
    r"^step (\d+)/\d+ \|.* ([\d,]+) tokens/s \|.*\| cpu (\d+) ms/step$", re.MULTILINE
)
TOKENS_PER_STEP = 8 * 32  # the job's global batch x seq_len


@pytest.fixture(scope="module")
def job(tmp_path_factory, write_code_corpus):
    root = tmp_path_factory.mktemp("e2e")
    corpus = write_code_corpus(root / "docs", n_docs=12, n_lines=40)
    config = {
        "model": dict(style="gpt2", hidden_size=32, num_layers=2, num_heads=4, seq_len=32),
        "parallel": {"pp": 2},
        "precision": {"dtype": "fp32"},
        "data": dict(paths=[str(corpus)], vocab_size=300, cache_dir=str(root / "cache")),
        "optimizer": dict(lr=1e-2, min_lr=1e-3, warmup_steps=2),
        "training": dict(steps=12, global_batch_size=8, micro_batch_size=2, eval_interval=6,
                         eval_batches=1, sample_tokens=8),
        "checkpoint": {"dir": str(root / "checkpoints")},
        "logging": dict(interval=3, tensorboard_dir=str(root / "tensorboard")),
    }  # fmt: skip
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return root, path


def _losses(stdout: str) -> list[float]:
    return [float(m.group(3)) for m in LINE.finditer(stdout)]


@pytest.fixture(scope="module")
def trained(job, run_mtcore):
    root, path = job
    before = _children_cpu_s()
    out = run_mtcore("train", path, "--nproc", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    out.cpu_s = _children_cpu_s() - before  # the launcher and both ranks, start-up included
    return root, out


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_train_on_two_ranks_learns_and_writes_outputs(trained):
    root, out = trained
    losses = _losses(out.stdout)
    assert len(losses) == 5, out.stdout  # step 1, then every 3rd
    assert losses[-1] < losses[0] - 0.5, out.stdout
    assert "2 ranks: tp=1 pp=2" in out.stdout and "eval step 12 | val loss" in out.stdout
    step_dir = root / "checkpoints" / "step_000012"
    assert (step_dir / "manifest.json").is_file() and (step_dir / "tokenizer.json").is_file()
    assert (root / "checkpoints" / "latest").read_text().strip() == "step_000012"
    assert list((root / "tensorboard").glob("events.out.tfevents.*"))
    assert "sample (8 tokens after 'def '):" in out.stdout


def test_log_lines_report_the_cpu_time_of_all_ranks(trained):
    """``cpu N ms/step``: both ranks' CPU time per step, summed at log time. Over an
    interval the ranks cannot use more CPU than the cores give in its wall time (a figure
    per interval, not per step, or counted twice, would), and all intervals together no
    more than the whole run's processes took."""
    _, out = trained
    found = [(int(s), TOKENS_PER_STEP / float(r.replace(",", "")), int(c))
             for s, r, c in TIMES.findall(out.stdout)]  # fmt: skip
    assert [s for s, _, _ in found] == [1, 3, 6, 9, 12], out.stdout
    cores = len(os.sched_getaffinity(0))
    for step, wall_s, cpu_ms in found[1:]:  # the first interval holds each rank's start
        assert 0 < cpu_ms <= 1.5 * cores * wall_s * 1e3, (step, wall_s, cpu_ms, cores)
    ends = [0] + [step for step, _, _ in found]  # each interval's steps: ends[i] - ends[i - 1]
    logged_s = sum((b - a) * c / 1e3 for a, b, (_, _, c) in zip(ends[:-1], ends[1:], found, strict=True))
    assert logged_s <= out.cpu_s, (logged_s, out.cpu_s)


def test_generate_from_the_checkpoint(trained, run_mtcore):
    root, _ = trained
    greedy = run_mtcore("generate", root / "checkpoints", "--prompt", "def ", "--max-new-tokens", "6")
    assert greedy.returncode == 0, greedy.stderr
    assert greedy.stdout.startswith("def ") and len(greedy.stdout) > len("def \n")
    again = run_mtcore("generate", root / "checkpoints", "--prompt", "def ", "--max-new-tokens", "6")
    assert again.stdout == greedy.stdout  # greedy is deterministic
    sampled = run_mtcore("generate", root / "checkpoints" / "step_000012", "--prompt", "def ",
                   "--top-k", "5", "--max-new-tokens", "6")  # fmt: skip
    assert sampled.returncode == 0 and sampled.stdout.startswith("def "), sampled.stderr


def test_torchrun_module_entry_trains_the_same(job, trained, run_command):
    root, path = job
    _, first = trained
    out = run_command(
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "mtcore.train", path, "--checkpoint.dir", root / "ck_torchrun",
        "--logging.tensorboard_dir", "null",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert _losses(out.stdout) == _losses(first.stdout)  # same seed, same layout: same numbers
    assert (root / "ck_torchrun" / "step_000012" / "manifest.json").is_file()


def test_bad_input_fails_before_any_rank_starts(job, run_mtcore):
    root, path = job
    cases = {
        "unknown config key 'parallel.tpp'": [path, "--nproc", "2", "--parallel.tpp", "2"],
        "world size 3 is not divisible by tp*cp*pp = 1*1*2": [path, "--nproc", "3"],
        "data path does not exist": [path, "--nproc", "2", "--data.paths", root / "missing"],
        "tokenizer has 300 token ids but model.vocab_size is 256": [
            path, "--nproc", "2", "--model.vocab_size", "256"],
    }  # fmt: skip
    with ThreadPoolExecutor(len(cases)) as pool:
        results = dict(zip(cases, pool.map(lambda a: run_mtcore("train", *a), cases.values()), strict=True))
    for message, out in results.items():
        assert out.returncode == 2, (message, out.stdout, out.stderr)
        assert message in out.stderr, (message, out.stderr)
        assert "step " not in out.stdout and "Traceback" not in out.stderr
