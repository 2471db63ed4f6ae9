"""Fixtures shared by tests in several directories.

* ``make_dist``: fake installed distributions for plugin-discovery tests.
* ``one_thread``: one torch thread for a test (opt in per module with
  ``pytestmark = pytest.mark.usefixtures("one_thread")``).
* ``cli_env``, ``run_command``, ``run_mtcore``, ``mtcore_script``: commands started
  as a user starts them, with no MTCORE_* selection, no GPU, one thread per process.
* ``write_code_corpus``: a small corpus of repetitive code-like documents.
* ``tiny_bert``: tiny HuggingFace BERTs for the HF interop tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import ClassVar

import pytest

# Triton's interpreter for the kernel pack's tests (tests/plugins/triton_pack): triton
# decides between compiling and interpreting when a function is decorated, its own
# ``tl`` library included, so the switch must be set before anything imports triton.
# megatron-core (the [megatron] extra) imports triton, and test modules that import
# it are collected before the pack's directory; set here, it precedes them all.
os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def make_dist(tmp_path, monkeypatch):
    """Install a real (metadata + module) distribution into a directory on sys.path.

    Entry points are read from ``*.dist-info/entry_points.txt`` by importlib.metadata,
    exactly as for a pip-installed plugin.
    """
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))

    def make(dist: str, module: str, source: str, entry: str | None = None, version: str = "1.0") -> Path:
        (root / f"{module}.py").write_text(textwrap.dedent(source))
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[mtcore.plugins]\n{entry or module} = {module}\n")
        return root

    return make


class TinyBert:
    """Random tiny transformers BERTs and padded inputs for the HF interop tests."""

    SIZES: ClassVar[dict] = dict(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=16,
        type_vocab_size=2,
        hidden_act="gelu",
        initializer_range=0.1,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )

    def __init__(self, transformers):
        self.transformers = transformers

    def model(self, seed: int = 0, **sizes):
        """A ``BertForPreTraining`` (eval mode, fp32, eager attention) of ``SIZES`` with
        ``sizes`` changed, its LayerNorms and biases moved off 1 and 0."""
        import torch

        torch.manual_seed(seed)
        sizes = {**self.SIZES, **sizes}
        config = self.transformers.BertConfig(**sizes, attn_implementation="eager")
        model = self.transformers.BertForPreTraining(config).eval()
        self.perturb_ones_and_zeros(model)
        return model

    @staticmethod
    def perturb_ones_and_zeros(model) -> None:
        """LayerNorms and biases start at 1 and 0; move them so the mapping of each matters."""
        import torch

        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "LayerNorm" in name or ".norm" in name or name.endswith("bias"):
                    p.add_(0.2 * torch.randn(p.shape, generator=g))

    @staticmethod
    def inputs(vocab_size: int = 96, seq_len: int = 16):
        """``(tokens, token_types, padding_mask)`` of 3 sequences: full, 11/16 and 5/16 of
        ``seq_len`` real tokens, the second half of each real part token type 1."""
        import torch

        g = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, vocab_size, (3, seq_len), generator=g)
        lengths = torch.tensor([[seq_len], [seq_len * 11 // 16], [seq_len * 5 // 16]])
        padding_mask = torch.arange(seq_len)[None] < lengths
        token_types = (torch.arange(seq_len)[None] >= lengths // 2).long().expand(3, -1).clone()
        return tokens, token_types, padding_mask

    @staticmethod
    def logits(model, tokens, token_types, padding_mask):
        """transformers' ``(MLM logits, pair logits or None)``."""
        import torch

        with torch.no_grad():
            out = model(
                input_ids=tokens, token_type_ids=token_types, attention_mask=padding_mask.long()
            )
        pair = getattr(out, "seq_relationship_logits", None)
        return (out.prediction_logits if pair is not None else out.logits), pair


@pytest.fixture
def tiny_bert() -> TinyBert:
    """Tiny HuggingFace BERTs (skips without transformers)."""
    return TinyBert(pytest.importorskip("transformers"))


# -- one torch thread ------------------------------------------------------------------
@pytest.fixture
def one_thread():
    """One torch thread during the test: on a shared two-core machine more threads spin
    and crawl."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- commands in fresh processes ---------------------------------------------------------
MTCORE_SCRIPT = Path(sys.executable).with_name("mtcore")


def _cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTCORE_")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", **extra)
    return env


def _run_command(*args, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, env=_cli_env(**env), timeout=timeout
    )


@pytest.fixture(scope="session")
def mtcore_script() -> Path:
    """The `mtcore` console script of this environment (next to the Python running the tests)."""
    return MTCORE_SCRIPT


@pytest.fixture(scope="session")
def cli_env():
    """``cli_env(**extra) -> dict``: this process's environment without any MTCORE_*
    variable, with no visible GPU, OMP_NUM_THREADS=1, and ``extra`` on top."""
    return _cli_env


@pytest.fixture(scope="session")
def run_command():
    """``run_command(*args, timeout=300, **env) -> CompletedProcess``: ``args`` (str()-ed)
    in a fresh process under ``cli_env(**env)``, stdout and stderr captured as text."""
    return _run_command


@pytest.fixture(scope="session")
def run_mtcore():
    """``run_mtcore(*args, timeout=300, **env)``: ``run_command`` of `mtcore ARGS`."""

    def run(*args, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
        return _run_command(MTCORE_SCRIPT, *args, timeout=timeout, **env)

    return run


# -- small corpora ---------------------------------------------------------------------
CODE_WORDS = ("alpha", "beta", "gamma", "delta", "token", "layer")


def _write_code_corpus(
    root: Path, n_docs: int, n_lines: int, words: tuple[str, ...] = CODE_WORDS
) -> Path:
    """``n_docs`` files ``docNN.py`` of ``n_lines`` two-line functions named from ``words``:
    repetitive enough that a tiny model's loss falls within a few steps."""
    root.mkdir(parents=True)
    n = len(words)
    for i in range(n_docs):
        body = "".join(
            f"def {words[(i + j) % n]}_{words[j % n]}(self, x):\n"
            f"    return self.{words[j % (n - 1)]} + x\n"
            for j in range(n_lines)
        )
        (root / f"doc{i:02d}.py").write_text(body)
    return root


@pytest.fixture(scope="session")
def write_code_corpus():
    """``write_code_corpus(root, n_docs, n_lines, words=CODE_WORDS) -> root``."""
    return _write_code_corpus

