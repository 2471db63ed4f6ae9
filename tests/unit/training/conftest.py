"""A small corpus on disk and tiny training configs for the trainer's tests."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

_NAMES = ["alpha", "beta", "gamma", "delta", "tensor", "shard", "rank", "token", "batch", "layer"]


def write_corpus(root: Path, n_docs: int = 20, seed: int = 0) -> Path:
    """Repetitive code-like documents: a tiny model's loss falls within a few steps."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        lines = []
        for _ in range(30):
            a, b = rng.sample(_NAMES, 2)
            lines.append(f"def {a}_{b}(self, {a}):\n    return self.{b} + {a}\n")
        (root / f"doc{i:02d}.py").write_text("".join(lines))
    return root


def tiny_config(corpus: Path, cache: Path, out: Path, **sections) -> dict:
    """A config dict for a model of a few thousand parameters; ``sections`` update it."""
    config = {
        "model": dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=32),
        "precision": {"dtype": "fp32"},
        "data": dict(paths=[str(corpus)], vocab_size=300, cache_dir=str(cache)),
        "optimizer": dict(lr=1e-2, min_lr=1e-3, warmup_steps=2),
        "training": dict(steps=8, global_batch_size=8, micro_batch_size=4, eval_interval=4,
                         eval_batches=1, sample_tokens=8),
        "checkpoint": {"dir": str(out / "checkpoints")},
        "logging": dict(interval=2, tensorboard_dir=str(out / "tensorboard"), progress="lines"),
    }  # fmt: skip
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def _every_test_on_one_thread(one_thread):
    """Every trainer test runs on one torch thread (``one_thread``, tests/conftest.py)."""


@pytest.fixture
def tiny(tmp_path, corpus, data_cache):
    """``tiny(**sections)``: a tiny config dict writing under tmp_path."""
    return lambda **sections: tiny_config(corpus, data_cache, tmp_path, **sections)
