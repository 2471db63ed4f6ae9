"""Every `mtcore ...` and `make ...` command the documentation shows is one that works.

The shell blocks (```bash, ```sh, ```shell, ```console) of README.md and docs/**/*.md
are read as a shell would split them (continuation lines, quotes, comments, pipes,
redirections, ``VAR=value`` prefixes, ``cd``), and every simple command whose program
is ``mtcore`` (or ``.../bin/mtcore``) or ``make`` is checked without running it:

* ``make X``: the Makefile has a target X;
* ``mtcore SUB ...``: the real parser (``mtcore.cli.main.build_parser``) accepts it;
* ``mtcore train CONFIG [--nproc N] [--nnodes N|MIN:MAX ...] [--section.key V ...]``:
  CONFIG exists (relative to the repository, or to the directory a ``cd`` earlier in
  the block moved to), ``load_config(CONFIG, overrides)`` validates it (unknown keys,
  bad values) and the layout and batch sizes fit the processes at every node count
  (``TrainConfig.check``). Nothing is trained
  and no data is prepared.

Every ```python block is run, each in a fresh interpreter from the repository root
(``test_documented_python_runs``). A block that cannot run here says why with a
marker line right above its fence, ``<!-- docs-test: not run (needs a GPU) -->``, or,
in a doc whose owner has not marked it yet, has an entry in ``PYTHON_NOT_RUN`` with
the error it must give; like ``ALLOWED``, an entry that passes or is gone fails.

Every shell block is also run, or says why not: a block with a ``SHELL_RUN`` entry is
run by bash (``set -eo pipefail``) in a throwaway copy of the repository's layout, as
shown or with the entry's replacements (``--backend cuda`` -> ``--backend cpu``) and
training shortened (``SHORT_TRAIN``); the cheap ones side by side in the default suite,
the long ones under ``-m slow``; cheap blocks whose commands the default suite runs
elsewhere too under ``-m extended`` (CI runs them after make test). A block that cannot run here (GPU, MUSA, Slurm, a
download, an install into the shared environment, the whole suite) carries the same
``docs-test: not run (reason)`` marker above its fence. A block with neither fails
``test_every_shell_block_runs_or_says_why``, which lists it as file:line.

A command that cannot pass for a reason of its own (a placeholder the reader fills
in) is listed in ``ALLOWED`` with that reason and the error it must give; an entry
whose command is gone from the docs, or that passes, fails the suite, so the list
stays small and honest.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
CONTROL = {"|", "||", "&&", ";", "&", "(", ")"}
REDIRECT = {">", ">>", "<", "<<", ">&", "<&", ">|", "&>"}

# Families that come from an example plugin under docs/examples rather than from
# mtcore: name -> the example's source directory. The test registers the example's
# plugin module in-process (PluginRegistry.register) when the family is not installed.
EXAMPLE_FAMILIES = {"gmlp": ROOT / "docs" / "examples" / "mtcore-example-family" / "src"}

# Commands that are expected not to pass, each with the error text it must give
# (proof that it fails for the stated reason and nothing else) and why that is fine.
ALLOWED: dict[str, tuple[str, str]] = {}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Command:
    doc: str  # path relative to the repository
    line: int  # 1-based line of the command's first line
    argv: tuple[str, ...]  # program first, as the shell would pass it
    cwd: Path  # where the block's `cd`s left the shell

    @property
    def text(self) -> str:
        return shlex.join(self.argv)

    @property
    def program(self) -> str:
        return Path(self.argv[0]).name

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


# -- extraction ------------------------------------------------------------------------
def shell_blocks(text: str):
    """``(language, first content line number, lines)`` of every shell fence in ``text``."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, indent = m["fence"], m["lang"].lower(), len(m["indent"])
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            line = lines[j]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            j += 1
        if lang in SHELL_LANGUAGES:
            yield lang, i + 2, body
        i = j + 1


def tokenize(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def logical_lines(lang: str, lines: list[str]):
    """``(index, tokens)`` of each shell command line: continuations joined, heredoc
    bodies skipped, console output (lines without a ``$`` prompt) left out."""
    i = 0
    while i < len(lines):
        start, line = i, lines[i]
        i += 1
        if lang == "console":
            if not line.startswith("$ "):
                continue
            line = line[2:]
        while line.rstrip().endswith("\\") and i < len(lines):
            line = line.rstrip()[:-1] + " " + lines[i]
            i += 1
        while True:
            try:
                tokens = tokenize(line)
                break
            except ValueError:  # an open quote: the command goes on
                if i >= len(lines):
                    raise
                line += "\n" + lines[i]
                i += 1
        heredoc = HEREDOC.search(line)
        if heredoc:
            while i < len(lines) and lines[i].strip() != heredoc.group(1):
                i += 1
            i += 1
        yield start, tokens


def simple_commands(tokens: list[str]):
    """The simple commands of a tokenized line: split at control operators, cut at the
    first redirection, leading ``VAR=value`` assignments dropped."""
    segment: list[str] = []
    for token in [*tokens, ";"]:
        if token in CONTROL:
            cut = next((k for k, t in enumerate(segment) if t in REDIRECT), len(segment))
            words = segment[:cut]
            while words and ASSIGNMENT.match(words[0]):
                words = words[1:]
            if words:
                yield words
            segment = []
        else:
            segment.append(token)


def is_program(word: str, name: str) -> bool:
    return word == name or word.endswith(f"/bin/{name}")


def commands_in(doc: Path, text: str | None = None) -> list[Command]:
    """Every ``mtcore`` and ``make`` command in ``doc``'s shell blocks."""
    text = doc.read_text() if text is None else text
    rel = doc.relative_to(ROOT).as_posix() if doc.is_relative_to(ROOT) else str(doc)
    found = []
    for lang, first, lines in shell_blocks(text):
        cwd = ROOT
        for index, tokens in logical_lines(lang, lines):
            for words in simple_commands(tokens):
                if words[0] == "cd" and len(words) == 2:
                    cwd = (cwd / words[1]).resolve()
                elif is_program(words[0], "mtcore") or is_program(words[0], "make"):
                    found.append(Command(rel, first + index, tuple(words), cwd))
    return found


@cache
def all_commands() -> tuple[Command, ...]:
    return tuple(c for doc in doc_files() for c in commands_in(doc))


# -- checks ----------------------------------------------------------------------------
class DocCommandError(AssertionError):
    """What is wrong with a documented command."""


@cache
def make_targets() -> frozenset[str]:
    rule = re.compile(r"^([A-Za-z0-9_.%/-]+(?:\s+[A-Za-z0-9_.%/-]+)*)\s*:(?!=)")
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = rule.match(line)
        if m:
            targets.update(m.group(1).split())
    return frozenset(targets)


def check_make(cmd: Command) -> None:
    for word in cmd.argv[1:]:
        if word.startswith("-") or "=" in word:
            continue
        if word not in make_targets():
            raise DocCommandError(f"the Makefile has no target {word!r}")


@cache
def cli_parser():
    from mtcore.cli.main import build_parser

    return build_parser()


def parse_cli(args: list[str]):
    """The namespace the real ``mtcore`` parser makes of ``args``; None for --help or
    --version (argparse exits 0); DocCommandError with argparse's message otherwise."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = cli_parser().parse_args(args)
    except SystemExit as e:
        if e.code in (0, None):
            return None
        message = err.getvalue().strip().splitlines()
        raise DocCommandError(f"the CLI refuses it: {message[-1] if message else e}") from None
    if ns.command is None:
        raise DocCommandError("no mtcore command given")
    return ns


@contextlib.contextmanager
def example_families():
    """The docs/examples families registered in this process while the block runs
    (unless already installed), then forgotten again."""
    from mtcore.backend import plugin_registry
    from mtcore.models import family_names, reset_plugin_families

    registry = plugin_registry()
    added, old_path = [], list(sys.path)
    try:
        missing = {n: src for n, src in EXAMPLE_FAMILIES.items() if n not in family_names()}
        for src in missing.values():
            plugin = next(src.glob("*/plugin.py"))
            name = plugin.parent.name
            sys.path.insert(0, str(src))
            module = importlib.import_module(f"{name}.plugin")
            registry.register(module, name)
            added.append(name)
        reset_plugin_families()
        yield
    finally:
        for name in added:
            registry.manager.unregister(name=name)
            registry.discovery.plugins.pop(name, None)
        sys.path[:] = old_path
        reset_plugin_families()


def check_train(cmd: Command, ns) -> None:
    from mtcore.training.overrides import load_config

    if ns.config is None:
        raise DocCommandError("no CONFIG: mtcore train refuses to start without one")
    path = (cmd.cwd / ns.config).resolve()
    if not path.is_file():
        raise DocCommandError(f"config file {ns.config} does not exist ({path})")
    try:
        with example_families():
            config = load_config(path, ns.overrides)
            for world in ns.launch.world_sizes():  # every node count --nnodes allows
                config.check(world)
    except ValueError as e:  # ConfigError, LayoutError, SplitError
        raise DocCommandError(f"the config does not validate: {e}") from None


def check(cmd: Command) -> None:
    """Raise DocCommandError when ``cmd`` would not get past argument checking."""
    if cmd.program == "make":
        check_make(cmd)
        return
    ns = parse_cli(list(cmd.argv[1:]))
    if ns is not None and ns.command == "train":
        check_train(cmd, ns)


def judge(cmd: Command, allowed: dict[str, tuple[str, str]] = ALLOWED) -> str | None:
    """What is wrong with ``cmd`` as documented, or None. An allowed command must fail,
    and with its expected error."""
    problem = None
    try:
        check(cmd)
    except DocCommandError as e:
        problem = str(e)
    if cmd.text not in allowed:
        return problem
    expected, reason = allowed[cmd.text]
    if problem is None:
        return f"ALLOWED to fail ({reason}), but it passes: remove it from ALLOWED"
    if expected not in problem:
        return f"ALLOWED to fail with {expected!r} ({reason}), but: {problem}"
    return None


# -- tests -----------------------------------------------------------------------------
COMMANDS = all_commands()


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{c.doc}:{c.line}" for c in COMMANDS])
def test_documented_command_works(cmd: Command):
    problem = judge(cmd)
    if problem is not None:
        pytest.fail(f"{cmd}\n  {problem}", pytrace=False)


def test_allowlist_entries_are_still_documented():
    documented = {c.text for c in COMMANDS}
    stale = sorted(set(ALLOWED) - documented)
    assert not stale, f"ALLOWED names commands no doc shows any more: {stale}"


def test_the_docs_show_the_main_commands():
    texts = {c.text for c in COMMANDS}
    for expected in (
        "make train",
        "make test",
        "mtcore train configs/default.yaml --nproc 4",
        "mtcore train configs/bert.yaml --nproc 4",
        "mtcore train configs/moe.yaml --nproc 4",
    ):
        assert expected in texts, f"no doc shows {expected!r}"
    assert len(COMMANDS) >= 40, len(COMMANDS)


# The checker itself: it must catch what it is there to catch.
SAMPLE = """\
Text, and a block:

```bash
make train   # fine
make trian
mtcore train configs/nope.yaml --nproc 4
mtcore train configs/default.yaml --nproc 4 --parallel.tpp 2
mtcore train configs/default.yaml --nproc 3
mtcore convert to-hf a b [--dtype bf16]
OMP_NUM_THREADS=1 .venv/bin/mtcore doctor --json | jq . > out.json  # fine
cd configs && mtcore train bert.yaml \\
    --nproc 4 --training.steps 5   # fine
```

```python
mtcore train not/a/shell/block.yaml
```

```console
$ mtcore plugins
mtcore_cuda  mtcore-cuda 0.1.0  ok
```
"""


def test_the_checker_catches_broken_commands():
    found = commands_in(ROOT / "SAMPLE.md", SAMPLE)
    verdicts = {}
    for cmd in found:
        try:
            check(cmd)
            verdicts[cmd.text] = "ok"
        except DocCommandError as e:
            verdicts[cmd.text] = str(e)
    expected = {  # command as extracted -> what its verdict says
        "make train": "ok",
        "make trian": "no target 'trian'",
        "mtcore train configs/nope.yaml --nproc 4": "configs/nope.yaml does not exist",
        "mtcore train configs/default.yaml --nproc 4 --parallel.tpp 2": "parallel.tpp",
        "mtcore train configs/default.yaml --nproc 3": "world size 3",
        "mtcore convert to-hf a b '[--dtype' 'bf16]'": "the CLI refuses it",
        ".venv/bin/mtcore doctor --json": "ok",
        "mtcore train bert.yaml --nproc 4 --training.steps 5": "ok",  # after `cd configs`
        "mtcore plugins": "ok",  # console: prompt lines only
    }
    assert list(verdicts) == list(expected)
    for text, needle in expected.items():
        ok = verdicts[text] == "ok" if needle == "ok" else needle in verdicts[text]
        assert ok, (text, verdicts[text])
    assert found[-2].cwd == ROOT / "configs"

    # The allowlist: an entry must fail, and for its stated reason.
    placeholder = next(c for c in found if c.program == "mtcore" and c.argv[1] == "convert")
    fine = next(c for c in found if c.text == "make train")
    assert judge(placeholder, {placeholder.text: ("unrecognized arguments", "sample")}) is None
    assert "but:" in judge(placeholder, {placeholder.text: ("config file", "sample")})
    assert "remove it from ALLOWED" in judge(fine, {fine.text: ("anything", "sample")})


# -- Python blocks: run them -----------------------------------------------------------
MARKER = re.compile(r"<!--\s*docs-test:\s*not run\s*\((?P<reason>[^)]+)\)\s*-->")

# doc -> first code line of a block -> (the error it must end with, why it cannot run).
PYTHON_NOT_RUN: dict[str, dict[str, tuple[str, str]]] = {
    "docs/hf-interop.md": {
        "from mtcore.models.gpt import GPT, build_gpt, load_full_weights": (
            "no HuggingFace model at path/to/llama",
            "needs a downloaded HuggingFace checkpoint at the reader's path",
        ),
        "from mtcore.models import get_family": (
            "no HuggingFace model at path/to/llama",
            "needs a downloaded HuggingFace checkpoint at the reader's path",
        ),
    },
    "docs/plugin-author-guide.md": {
        "@hookimpl": ("NameError: name 'hookimpl'", "continues the plugin module shown above it"),
        "def sigmoid_swiglu(x: Tensor) -> Tensor:": (
            "NameError: name 'Tensor'",
            "a fragment of the kernel module shown above it",
        ),
        "from mtcore.backend import PluginRegistry, select_backend": (
            "No module named 'mtcore_myaccel'",
            "imports the guide's example accelerator plugin, which is not installed",
        ),
    },
}


@dataclass(frozen=True)
class PythonBlock:
    doc: str
    line: int  # 1-based line of the first code line
    code: str
    marker: str | None  # the reason of a `docs-test: not run` marker above the fence

    @property
    def first_line(self) -> str:
        return next((line.strip() for line in self.code.splitlines() if line.strip()), "")


def python_blocks(doc: Path, text: str | None = None) -> list[PythonBlock]:
    text = doc.read_text() if text is None else text
    rel = doc.relative_to(ROOT).as_posix() if doc.is_relative_to(ROOT) else str(doc)
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if m["lang"].lower() in ("python", "py"):
            above = lines[i - 1] if i > 0 else ""
            marker = MARKER.search(above)
            code = "\n".join(line[indent:] for line in lines[i + 1 : j])
            blocks.append(PythonBlock(rel, i + 2, code, marker["reason"] if marker else None))
        i = j + 1
    return blocks


@cache
def all_python_blocks() -> tuple[PythonBlock, ...]:
    return tuple(b for doc in doc_files() for b in python_blocks(doc))


def run_block(block: PythonBlock) -> tuple[int, str]:
    """(exit status, last line of stderr) of the block in a fresh interpreter."""
    import os
    import subprocess

    examples = os.pathsep.join(str(src) for src in EXAMPLE_FAMILIES.values())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MTCORE_BACKEND": "cpu"}
    env["PYTHONPATH"] = examples + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run(
        [sys.executable, "-c", block.code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    lines = run.stderr.strip().splitlines()
    return run.returncode, (lines[-1] if lines else "")


BLOCKS = all_python_blocks()


@pytest.fixture(scope="module")
def python_results() -> dict[tuple[str, int], tuple[int, str]]:
    """Every runnable block, run side by side (each is mostly one interpreter's start-up)."""
    from concurrent.futures import ThreadPoolExecutor

    runnable = [b for b in BLOCKS if b.marker is None]
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {(b.doc, b.line): pool.submit(run_block, b) for b in runnable}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.doc}:{b.line}" for b in BLOCKS])
def test_documented_python_runs(block: PythonBlock, python_results):
    if block.marker is not None:
        pytest.skip(f"marked not run here: {block.marker}")
    expected = PYTHON_NOT_RUN.get(block.doc, {}).get(block.first_line)
    status, last = python_results[block.doc, block.line]
    where = f"{block.doc}:{block.line}"
    if expected is None:
        assert status == 0, f"{where}: the block fails: {last}"
        return
    error, reason = expected
    assert status != 0, f"{where}: in PYTHON_NOT_RUN ({reason}) but it runs: remove the entry"
    assert error in last, f"{where}: expected to fail with {error!r} ({reason}), but: {last}"


def test_python_not_run_entries_are_still_documented():
    shown = {(b.doc, b.first_line) for b in BLOCKS}
    stale = [(doc, line) for doc, entries in PYTHON_NOT_RUN.items() for line in entries]
    assert not [e for e in stale if e not in shown], "PYTHON_NOT_RUN names blocks no doc shows"


def test_the_block_reader_sees_markers_and_indented_blocks():
    sample = (
        "<!-- docs-test: not run (needs a GPU) -->\n```python\nimport torch\n```\n\n"
        "* item:\n\n  ```python\n  x = 1\n  assert x == 1\n  ```\n"
    )
    marked, indented = python_blocks(ROOT / "SAMPLE.md", sample)
    assert marked.marker == "needs a GPU" and marked.line == 3
    assert indented.code == "x = 1\nassert x == 1" and indented.marker is None
    assert run_block(indented) == (0, "")


# -- docs/training.md "Your own data": its commands run, shortened ---------------------
SHORTEN = [
    "--nproc", "1", "--parallel.tp", "1", "--parallel.pp", "1", "--model.hidden_size", "32",
    "--model.num_layers", "2", "--model.seq_len", "16", "--data.vocab_size", "300",
    "--training.steps", "2", "--training.global_batch_size", "4", "--training.micro_batch_size",
    "4", "--training.eval_interval", "0", "--training.sample_tokens", "0",
    "--checkpoint.dir", "null", "--logging.tensorboard_dir", "null",
]  # fmt: skip


def _own_data_inputs(cwd: Path) -> None:
    """The files the section's examples name, small: a few dozen documents each."""
    import json

    docs = [
        f"def f{i}(x):\n    return x + {i}  # document {i} " + "word " * (i % 7) for i in range(40)
    ]
    (cwd / "books.txt").write_text("\n\n".join(docs))
    (cwd / "web.jsonl").write_text(
        "".join(json.dumps({"text": d, "content": d}) + "\n" for d in docs)
    )
    from mtcore.data.tokenizer import train_tokenizer

    (cwd / "tokenizer.json").write_text(train_tokenizer(docs * 3, 300).to_str())
    pa = pytest.importorskip("pyarrow")
    pytest.importorskip("pyarrow.parquet").write_table(
        pa.table({"text": docs}), cwd / "shard-000.parquet"
    )
    pytest.importorskip("datasets").Dataset.from_dict({"text": docs}).save_to_disk(
        str(cwd / "my_dataset")
    )
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import numpy as np
    import torch

    (cwd / "data").mkdir()
    prefix = str(cwd / "data" / "my-corpus_text_document")
    builder = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for i in range(60):
        builder.add_item(torch.arange(1, 20 + i % 9) % 299 + 1)
        builder.end_document()
    builder.finalize(prefix + ".idx")


@pytest.mark.slow
def test_your_own_data_examples_run(tmp_path, monkeypatch, capsys):
    """Every command of docs/training.md's "Your own data" section, in a directory holding
    the files it names, trains (shortened by SHORTEN) or prepares data: exit 0."""
    from mtcore.cli.main import main

    doc = ROOT / "docs" / "training.md"
    text = doc.read_text()
    start, end = text.index("## Your own data"), text.index("## What is checked before")
    first, last = text[:start].count("\n") + 1, text[:end].count("\n") + 1
    commands = [c for c in commands_in(doc) if first <= c.line <= last]
    assert len(commands) >= 8, [str(c) for c in commands]
    _own_data_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MTCORE_DATA_CACHE", str(tmp_path / "cache"))
    for cmd in commands:
        argv = [str(ROOT / a) if a.startswith("configs/") else a for a in cmd.argv[1:]]
        if argv[0] == "train":
            argv += SHORTEN
        status = main(argv)
        out = capsys.readouterr()
        assert status == 0, f"{cmd}: exit {status}\n{out.err[-2000:]}"


# -- shell blocks: run them, or say why not --------------------------------------------
@dataclass(frozen=True)
class ShellBlock:
    doc: str
    line: int  # 1-based line of the first content line
    lang: str
    lines: tuple[str, ...]
    marker: str | None  # the reason of a `docs-test: not run` marker above the fence

    @property
    def first_line(self) -> str:
        return next((line.strip() for line in self.lines if line.strip()), "")

    def script(self) -> str:
        """The block as a shell reads it: for ```console, the ``$`` lines only."""
        if self.lang != "console":
            return "\n".join(self.lines)
        kept, going_on = [], False  # a `$` line and the lines its backslashes continue
        for line in self.lines:
            if line.startswith("$ ") or going_on:
                kept.append(line[2:] if line.startswith("$ ") and not going_on else line)
                going_on = line.rstrip().endswith("\\")
        return "\n".join(kept)


def shell_block_list(doc: Path, text: str | None = None) -> list[ShellBlock]:
    """Every shell block of ``doc`` (found by ``shell_blocks``) with its marker."""
    text = doc.read_text() if text is None else text
    rel = doc.relative_to(ROOT).as_posix() if doc.is_relative_to(ROOT) else str(doc)
    lines = text.splitlines()
    found = []
    for lang, first, body in shell_blocks(text):
        above = lines[first - 3] if first >= 3 else ""  # the line above the fence
        marker = MARKER.search(above)
        found.append(
            ShellBlock(rel, first, lang, tuple(body), marker["reason"] if marker else None)
        )
    return found


@cache
def all_shell_blocks() -> tuple[ShellBlock, ...]:
    return tuple(b for doc in doc_files() for b in shell_block_list(doc))


@dataclass(frozen=True)
class ShellRun:
    """How a shell block runs here: as shown, or with ``replace`` pairs (shown -> run
    instead; each must still be in the block) and, with ``shorten``, SHORT_TRAIN added to
    each training command. ``after`` names blocks (doc, first line) run first in the same
    shell, the steps the doc says come before. ``covered_by`` names the test of this file
    that already runs the block's commands; ``needs``, a program outside the venv that the
    block uses (the test skips without it). ``extended``: a cheap block whose commands
    the default suite runs elsewhere too (``mtcore doctor``'s, test_cli.py): CI runs it
    after make test (``-m extended``)."""

    slow: bool = False
    extended: bool = False
    shorten: bool = False
    replace: tuple[tuple[str, str], ...] = ()
    after: tuple[tuple[str, str], ...] = ()
    covered_by: str | None = None
    needs: str | None = None


CHEAP = ShellRun()
EXTENDED = ShellRun(extended=True)
SLOW_SHORT = ShellRun(slow=True, shorten=True)
SHORT_TRAIN = "--training.steps 2 --training.eval_interval 0 --training.sample_tokens 0"
NO_CUDA = (("--backend cuda", "--backend cpu"),)  # the same check, on the backend here
EXAMPLE_FAMILY_TARGET = (
    ("/tmp/example-family", "$PWD/target/example-family"),
)  # absolute: a later cd
EXAMPLE_FAMILY_INSTALL = (
    "docs/plugin-author-guide.md",
    "pip install --no-deps --no-build-isolation --target /tmp/example-family docs/examples/"
    "mtcore-example-family",
)

MEGATRON_IMPORT = (
    "docs/migrating-from-megatron.md",
    "mtcore convert from-megatron megatron/gpt_tiny runs/gpt_tiny/from-megatron",
)
# No Megatron checkpoint here: the config trains 2 steps and mtcore exports it as one.
MEGATRON_CHECKPOINT_FIRST = (
    (
        MEGATRON_IMPORT[1],
        "mtcore train docs/examples/megatron/gpt_tiny.yaml --nproc 4 --checkpoint.dir runs/seed\n"
        "mtcore convert to-megatron runs/seed megatron/gpt_tiny --tp 2 --pp 2\n"
        + MEGATRON_IMPORT[1],
    ),
)

# doc -> first line of a block -> how it runs. A block without an entry needs a marker.
SHELL_RUN: dict[str, dict[str, ShellRun]] = {
    "docs/backends.md": {
        "$ mtcore plugins": CHEAP,
        "mtcore doctor                  # plugins, model families, every backend; details for "
        "each available one": ShellRun(replace=NO_CUDA, extended=True),
    },
    "docs/ci.md": {
        '.venv/bin/python -c "import torch; print(torch.__version__)"   # 2.13.0+cpu': EXTENDED,
        ".venv/bin/python -m pytest --pyargs mtcore.testing.conformance --mtcore-backend cpu -q": (
            ShellRun(slow=True)
        ),
        ".venv/bin/mtcore doctor --json > doctor.json          # keep it as a build artifact": (
            ShellRun(replace=NO_CUDA, extended=True)
        ),
        ".venv/bin/mtcore doctor --json | .venv/bin/python -c '": CHEAP,
        "mtcore doctor --json | jq -e '[.plugins[] | select(.status == \"broken\")] | length == 0'": (
            ShellRun(needs="jq", extended=True)
        ),
    },
    "docs/examples/mtcore-example-family/README.md": {
        "pip install --no-deps --no-build-isolation --target /tmp/example-family docs/examples/"
        "mtcore-example-family": ShellRun(slow=True, replace=EXAMPLE_FAMILY_TARGET),
    },
    "docs/examples/mtcore-example-plugin/README.md": {
        "pip install --no-deps --no-build-isolation --target /tmp/example-plugin docs/examples/"
        "mtcore-example-plugin": ShellRun(
            slow=True, replace=(("/tmp/example-plugin", "$PWD/target/example-plugin"),)
        ),
    },
    "docs/fp8.md": {
        "mtcore train configs/default.yaml --nproc 4 --precision.fp8 hybrid --precision.fp8_recipe"
        " delayed": SLOW_SHORT,
    },
    "docs/kernels.md": {'TRITON_INTERPRET=1 .venv/bin/python -c "': CHEAP},
    "docs/migrating-from-megatron.md": {
        "mtcore convert megatron-args docs/examples/megatron/run_gpt_tiny.sh > docs/examples/"
        "megatron/gpt_tiny.yaml": CHEAP,
        MEGATRON_IMPORT[1]: ShellRun(slow=True, shorten=True, replace=MEGATRON_CHECKPOINT_FIRST),
        "mtcore convert to-megatron runs/gpt_tiny/checkpoints megatron/gpt_tiny_back --tp 2 --pp 2": (
            ShellRun(slow=True, after=(MEGATRON_IMPORT,))
        ),
    },
    "docs/models.md": {
        "mtcore train configs/default.yaml --nproc 4     # model.family unset: gpt": SLOW_SHORT,
    },
    "docs/moe.md": {
        "mtcore train configs/moe.yaml --nproc 4      # tp2 x dp2 (4 ranks), experts over ep2, "
        "ZeRO-1, fp32, 200 steps": SLOW_SHORT,
        "mtcore train configs/deepseek.yaml --nproc 4   # tp2 x dp2, 16 experts over ep2, ZeRO-1, "
        "fp32, 150 steps": SLOW_SHORT,
    },
    "docs/multimodal.md": {
        "mtcore train configs/llava.yaml --nproc 4 --model.freeze '[vision, language]' "
        "--checkpoint.dir runs/llava-stage1": SLOW_SHORT,
    },
    "docs/plan.md": {
        "mtcore plan configs/default.yaml --gpus 4 --hardware cpu-host": EXTENDED,
        "mtcore plan configs/llava.yaml --gpus 4 --hardware cpu-host": CHEAP,
        "mtcore plan configs/default.yaml --gpus 4 --hardware cpu-host --trace planned.json.gz": (
            CHEAP
        ),
        "mtcore plan configs/default.yaml --gpus 4 --hardware cpu-host --backend cpu": CHEAP,
        "mtcore plan configs/default.yaml --gpus 4 --hardware cpu-host --compare tp=1,pp=4 "
        "tp=1,pp=4,schedule=zb_h1": CHEAP,
        "mtcore plan configs/default.yaml --gpus 8192 --hardware docs/examples/hardware/"
        "h100-meta-roce.toml \\": CHEAP,
        "mtcore plan configs/default.yaml --gpus 992 --hardware A100-80GB --model.style gpt2 \\": (
            CHEAP
        ),
        "mtcore plan configs/default.yaml --gpus 16384 --hardware docs/examples/hardware/"
        "h100-meta-roce.toml \\": CHEAP,
        "mtcore plan configs/deepseek.yaml --gpus 2048 --hardware docs/examples/hardware/"
        "h800-deepseek.toml \\": CHEAP,
        "mtcore sweep configs/default.yaml --layouts tp=2,pp=1 tp=1,pp=2 tp=1,pp=1 --nproc 2 "
        "--steps 6": ShellRun(slow=True, replace=(("--steps 6", "--steps 2"),)),
        "mtcore plan configs/default.yaml --gpus 4 --hardware cpu-host --compare tp=2,pp=2 "
        "tp=1,pp=2 tp=2,pp=1 tp=1,pp=4 --plot runs/plan/layouts.png": CHEAP,
        "mtcore sweep configs/default.yaml --layouts tp=2,pp=2 tp=1,pp=2 tp=2,pp=1 tp=1,pp=4 "
        "--nproc 4 --steps 6 --trace": ShellRun(slow=True, replace=(("--steps 6", "--steps 2"),)),
    },
    "docs/plugin-author-guide.md": {
        "python docs/examples/c10d-backend/toyccl.py": CHEAP,
        EXAMPLE_FAMILY_INSTALL[1]: ShellRun(slow=True, replace=EXAMPLE_FAMILY_TARGET),
        "cd docs/examples/mtcore-example-family": ShellRun(
            slow=True, shorten=True, after=(EXAMPLE_FAMILY_INSTALL,)
        ),
        "python - <<'PY'": ShellRun(
            slow=True,
            after=(  # which runs the install before it
                ("docs/plugin-author-guide.md", "cd docs/examples/mtcore-example-family"),
            ),
        ),
        "mtcore new-plugin myaccel                                  # device type myaccel, c10d "
        "gloo": CHEAP,
    },
    "docs/finetuning.md": {
        "mtcore train configs/sft.yaml --nproc 2       # tp=2; the set and its tokenizer go into "
        "the data cache": SLOW_SHORT,
        "python -m mtcore.data.chat_corpus chat-set   # chat-set/train.jsonl, heldout.jsonl, "
        "tokenizer/": SLOW_SHORT,
        "mtcore train configs/default.yaml --nproc 4 --data.document_masks true "
        "--data.reset_position_ids true": SLOW_SHORT,
        # The workflow: import, LoRA and full fine-tuning, generate, export, peft. CI runs
        # it (extended): it is the one path through every part of fine-tuning.
        "python -m mtcore.data.chat_corpus chat-set                              # the chat "
        "set and its ChatML tokenizer": ShellRun(extended=True, shorten=True),
    },
    "docs/training.md": {
        "make train                                       # = mtcore train configs/default.yaml "
        "--nproc 4": ShellRun(
            slow=True,
            shorten=True,
            replace=(("make train", "mtcore train configs/default.yaml --nproc 4"),),
        ),
        "mtcore train configs/default.yaml --nproc 2 --parallel.pp 1 --precision.dtype fp32 "
        "--training.steps 20": SLOW_SHORT,
        "# one .txt file of many documents, blank lines between them (a BPE is trained on it)": (
            ShellRun(slow=True, covered_by="test_your_own_data_examples_run")
        ),
        "mtcore data prepare books.txt web.jsonl my_dataset/ --config configs/default.yaml "
        "--output data/corpus": ShellRun(slow=True, covered_by="test_your_own_data_examples_run"),
        "mtcore train configs/long_context.yaml --nproc 4        # 2048 tokens, cp 4, ring": (
            SLOW_SHORT
        ),
        "mtcore train configs/default.yaml --nproc 4 --parallel.tp 1 --parallel.pp 1 \\": (
            SLOW_SHORT
        ),
        "mtcore train configs/default.yaml --nproc 4 --parallel.tp 1 --parallel.pp 4 "
        "--parallel.schedule zb_h1": SLOW_SHORT,
        # two 4-rank jobs (test_sweep_trace.py, extended, runs the same sweep and reads its files)
        "mtcore sweep configs/default.yaml --layouts tp=2,pp=2 tp=1,pp=2 --nproc 4 --steps 2 "
        "--trace": ShellRun(slow=True),
        # shortened to 2 steps: the trace holds step 2, and merge reads it
        "mtcore train configs/default.yaml --nproc 4 --profile 2:3 --logging.profile.memory "
        "true": SLOW_SHORT,
    },
}


def shell_run(block: ShellBlock) -> ShellRun | None:
    return SHELL_RUN.get(block.doc, {}).get(block.first_line)


def find_block(doc: str, first_line: str) -> ShellBlock:
    found = [b for b in all_shell_blocks() if (b.doc, b.first_line) == (doc, first_line)]
    assert found, f"no shell block of {doc} starts with {first_line!r}"
    return found[0]


TRAIN_COMMAND = re.compile(r"\bmtcore train\b|-m mtcore\.train\b")
COMMENT = re.compile(r"^(?P<code>.*?)(?P<comment>\s+#\s.*)?$")


def runnable_script(block: ShellBlock, run: ShellRun) -> str:
    """The shell text the test runs for ``block``: its ``after`` blocks first, then the
    block with ``run``'s replacements and, with ``shorten``, SHORT_TRAIN added to each
    training command (before a trailing comment). ValueError when a replacement is gone."""
    parts = []
    for doc, first in run.after:
        earlier = find_block(doc, first)
        parts.append(runnable_script(earlier, shell_run(earlier) or CHEAP))
    text = block.script()
    for shown, instead in run.replace:
        if shown not in text:
            raise ValueError(f"{block.doc}:{block.line}: {shown!r} is no longer in the block")
        text = text.replace(shown, instead)
    if run.shorten:
        lines = re.sub(r"\s*\\\n\s*", " ", text).splitlines()
        for k, line in enumerate(lines):
            if TRAIN_COMMAND.search(line):
                m = COMMENT.match(line)
                lines[k] = f"{m['code']} {SHORT_TRAIN}{m['comment'] or ''}"
        text = "\n".join(lines)
    parts.append(text)
    return "\n".join(parts)


def shell_workspace(where: Path) -> Path:
    """A directory that looks like the repository to a block (configs, .venv, src,
    plugins, benchmarks, Makefile linked; docs copied, since pip builds in the source
    tree), so what a block writes (doctor.json, runs/, new plugins) lands outside it."""
    import shutil

    where.mkdir(parents=True, exist_ok=True)
    for name in ("configs", ".venv", "src", "plugins", "benchmarks", "Makefile"):
        (where / name).symlink_to(ROOT / name)
    shutil.copytree(ROOT / "docs", where / "docs")
    return where


def run_shell_block(block: ShellBlock, run: ShellRun, where: Path) -> tuple[int, str]:
    """(exit status, the output's tail) of ``block`` run by bash with ``set -eo
    pipefail`` in a fresh workspace under ``where``, the venv's programs first on PATH."""
    import os
    import subprocess

    cwd = shell_workspace(where)
    home = where / "home"  # not the workspace: its src/ is the repository's
    home.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(home)}
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["MTCORE_DATA_CACHE"] = str(cwd / "cache")
    env.pop("MTCORE_BACKEND", None)
    script = "set -eo pipefail\n" + runnable_script(block, run)
    done = subprocess.run(
        ["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=1800
    )
    return done.returncode, (done.stdout + done.stderr)[-3000:]


SHELL_BLOCKS = all_shell_blocks()
RUN_HERE = [b for b in SHELL_BLOCKS if shell_run(b) is not None and not shell_run(b).covered_by]
CHEAP_BLOCKS = [b for b in RUN_HERE if not shell_run(b).slow and not shell_run(b).extended]
EXTENDED_BLOCKS = [b for b in RUN_HERE if shell_run(b).extended]


def unaccounted(blocks) -> tuple[list[str], list[str]]:
    """(blocks with neither a SHELL_RUN entry nor a marker, blocks with both), as
    file:line: first command."""
    neither = [f"{b.doc}:{b.line}: {b.first_line}" for b in blocks
               if b.marker is None and shell_run(b) is None]  # fmt: skip
    both = [f"{b.doc}:{b.line}: {b.first_line}" for b in blocks if b.marker and shell_run(b)]
    return neither, both


def test_every_shell_block_runs_or_says_why():
    """A shell block has a SHELL_RUN entry (it runs in a test) or a `docs-test: not run`
    marker above its fence (why it cannot run here); not both, not neither."""
    neither, both = unaccounted(SHELL_BLOCKS)
    assert not neither, (
        "shell blocks that neither run in a test (SHELL_RUN) nor say why not "
        "(<!-- docs-test: not run (reason) --> above the fence):\n  " + "\n  ".join(neither)
    )
    assert not both, f"blocks with a marker and a SHELL_RUN entry: {both}"


def test_the_shell_block_check_lists_unaccounted_blocks():
    sample = "```bash\nmtcore plugins\n```\n<!-- docs-test: not run (GPU) -->\n```sh\nx\n```\n"
    blocks = shell_block_list(ROOT / "SAMPLE.md", sample)
    assert unaccounted(blocks) == (["SAMPLE.md:2: mtcore plugins"], [])


def test_shell_run_entries_are_still_documented():
    shown = {(b.doc, b.first_line) for b in SHELL_BLOCKS}
    stale = [(d, f) for d, entries in SHELL_RUN.items() for f in entries if (d, f) not in shown]
    assert not stale, f"SHELL_RUN names blocks no doc shows: {stale}"
    for block in SHELL_BLOCKS:
        run = shell_run(block)
        if run is not None and run.covered_by:
            assert callable(globals().get(run.covered_by)), run.covered_by
        if run is not None:
            runnable_script(block, run)  # every replacement still applies


def skip_without_needs(run: ShellRun) -> None:
    import shutil

    if run.needs and shutil.which(run.needs) is None:
        pytest.skip(f"{run.needs} is not installed")


def run_side_by_side(blocks, root: Path) -> dict[tuple[str, int], tuple[int, str]]:
    """``run_shell_block`` of each of ``blocks`` (cheap ones: each is mostly one
    interpreter's start-up), four at a time, keyed by (doc, line)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {
            (b.doc, b.line): pool.submit(run_shell_block, b, shell_run(b), root / str(k))
            for k, b in enumerate(blocks)
        }
        return {key: f.result() for key, f in futures.items()}


@pytest.fixture(scope="module")
def cheap_results(tmp_path_factory):
    return run_side_by_side(CHEAP_BLOCKS, tmp_path_factory.mktemp("shell-blocks"))


@pytest.fixture(scope="module")
def extended_results(tmp_path_factory):
    return run_side_by_side(EXTENDED_BLOCKS, tmp_path_factory.mktemp("extended-blocks"))


@pytest.mark.parametrize(
    "block", CHEAP_BLOCKS, ids=[f"{b.doc}:{b.line}" for b in CHEAP_BLOCKS]
)  # fmt: skip
def test_documented_shell_block_runs(block: ShellBlock, cheap_results):
    skip_without_needs(shell_run(block))
    status, tail = cheap_results[(block.doc, block.line)]
    assert status == 0, f"{block.doc}:{block.line}: exit {status}\n{tail}"


@pytest.mark.extended
@pytest.mark.parametrize(
    "block", EXTENDED_BLOCKS, ids=[f"{b.doc}:{b.line}" for b in EXTENDED_BLOCKS]
)  # fmt: skip
def test_documented_extended_shell_block_runs(block: ShellBlock, extended_results):
    skip_without_needs(shell_run(block))
    status, tail = extended_results[(block.doc, block.line)]
    assert status == 0, f"{block.doc}:{block.line}: exit {status}\n{tail}"


SLOW_BLOCKS = [b for b in RUN_HERE if shell_run(b).slow]


@pytest.mark.slow
@pytest.mark.parametrize("block", SLOW_BLOCKS, ids=[f"{b.doc}:{b.line}" for b in SLOW_BLOCKS])
def test_documented_long_shell_block_runs(block: ShellBlock, tmp_path):
    skip_without_needs(shell_run(block))
    status, tail = run_shell_block(block, shell_run(block), tmp_path)
    assert status == 0, f"{block.doc}:{block.line}: exit {status}\n{tail}"


SHELL_SAMPLE = """\
<!-- docs-test: not run (needs a GPU) -->
```bash
mtcore doctor --backend cuda
```

```console
$ mtcore train configs/default.yaml \\
    --nproc 4   # four ranks
output, not a command
```
"""


def test_the_shell_block_reader_sees_markers_and_shortens():
    marked, console = shell_block_list(ROOT / "SAMPLE.md", SHELL_SAMPLE)
    assert (marked.marker, marked.line, console.marker) == ("needs a GPU", 3, None)
    assert console.script() == "mtcore train configs/default.yaml \\\n    --nproc 4   # four ranks"
    block = ShellBlock("SAMPLE.md", 1, "bash", ("mtcore train c.yaml \\", "  --nproc 4  # x"), None)
    script = runnable_script(block, ShellRun(shorten=True, replace=(("c.yaml", "d.yaml"),)))
    assert script == f"mtcore train d.yaml --nproc 4 {SHORT_TRAIN}  # x"
    with pytest.raises(ValueError, match="no longer in the block"):
        runnable_script(block, ShellRun(replace=(("e.yaml", "f.yaml"),)))
