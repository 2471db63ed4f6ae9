"""Work on training data: `mtcore data prepare INPUT... [--tokenizer FILE] --output PREFIX`.

`prepare` tokenizes text, .jsonl, .parquet files and HuggingFace `datasets`
directories (written by `save_to_disk`), or directories of them, into one mtcore
`PREFIX.bin`/`PREFIX.idx` pair, with several worker processes, a progress line on
stderr and a summary (documents, tokens, seconds). A `.txt` file holds documents
separated by blank lines (`--txt-separator`); a `.jsonl` line, parquet row or dataset
record is one document (`--text-key`). Run it again after an interruption and the
input files already done are skipped; run it again on the same inputs and it does
nothing. Train on the result with
`mtcore train CONFIG --data.paths PREFIX --data.tokenizer FILE` (docs/training.md).
Parquet and `datasets` directories need the optional extra `mtcore[datasets]`.
Without `--tokenizer`, the data is tokenized with the tokenizer `mtcore train` uses for
`--config CONFIG` (none: the built-in defaults): its `data.tokenizer`, else the BPE it
trains on that config's corpus (cached); where it came from is said, and a copy is
written to `PREFIX.tokenizer.json`, the `--data.tokenizer` to train with.

`--format chat` renders conversations instead (.jsonl, .parquet, `datasets`
directories; `messages`, or `prompt`/`completion`) with the tokenizer's own chat
template (a tokenizer.json beside its tokenizer_config.json, or a HF tokenizer
directory; `--chat-template` for one without) and writes the tokens and the loss mask
once, `PREFIX.bin/.idx/.mask/.json`; train on it with `--data.format chat --data.paths
PREFIX --data.tokenizer TOKENIZER` (docs/finetuning.md). It needs `mtcore[sft]`.

Exit status: 0 done; 2 bad input, nothing written (a missing, unreadable or non-UTF-8
input, named with its line; an output whose directory does not exist or cannot be
written; a bad tokenizer); 1 writing failed (a full disk), the finished input files
kept for the next run.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

HELP = "tokenize a corpus into .bin/.idx for training (mtcore data prepare)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    prep = actions.add_parser(
        "prepare",
        help="text/jsonl/parquet/datasets + a tokenizer -> PREFIX.bin/.idx",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help="files or directories")
    prep.add_argument(
        "--tokenizer",
        metavar="FILE",
        help="a tokenizer.json (chat: or a HF tokenizer directory); default: the one "
        "`mtcore train --config`'s CONFIG uses, copied to PREFIX.tokenizer.json",
    )
    prep.add_argument(
        "--config",
        metavar="CONFIG",
        help="without --tokenizer: the training config whose tokenizer to use (its "
        "data.tokenizer, else the BPE mtcore train trains on its corpus); default: the "
        "built-in defaults",
    )
    prep.add_argument(
        "--format",
        choices=("text", "chat"),
        default="text",
        help="text: documents (default); chat: conversations, tokens and loss mask",
    )
    prep.add_argument(
        "--chat-template",
        metavar="TEMPLATE|FILE",
        help="chat: a Jinja chat template, or a file holding one, for a tokenizer without one",
    )
    prep.add_argument("--output", required=True, metavar="PREFIX", help="writes PREFIX.bin/.idx")
    prep.add_argument(
        "--text-key", default="text", metavar="KEY", help="jsonl/parquet/datasets field (text)"
    )
    prep.add_argument(
        "--txt-separator",
        default="",
        metavar="SEP",
        help="split .txt files at SEP (default: at blank lines; 'none': one document per file)",
    )
    prep.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        metavar="N",
        help="tokenizer processes (default: cores, at most 8)",
    )


def run(args: argparse.Namespace) -> int:
    from mtcore.data import DataError
    from mtcore.data.prepare import prepare_data
    from mtcore.data.progress import report_to

    separator = None if args.txt_separator.lower() == "none" else _unescape(args.txt_separator)
    if args.workers < 1:
        print(
            f"mtcore data prepare: error: --workers must be at least 1, got {args.workers}",
            file=sys.stderr,
        )
        return 2
    problem = _output_problem(args.output)
    if problem is not None:
        print(f"mtcore data prepare: error: --output {args.output}: {problem}", file=sys.stderr)
        return 2
    if args.chat_template is not None and args.format != "chat":
        print("mtcore data prepare: error: --chat-template needs --format chat", file=sys.stderr)
        return 2
    if args.tokenizer is None and args.format == "chat":
        print(
            "mtcore data prepare: error: --format chat needs --tokenizer (a chat model's "
            "tokenizer, whose template renders the conversations)",
            file=sys.stderr,
        )
        return 2
    if args.tokenizer is not None and args.config is not None:
        print("mtcore data prepare: error: give --tokenizer or --config, not both", file=sys.stderr)
        return 2
    from mtcore.training.config import ConfigError

    report_to(sys.stderr)
    try:
        if args.format == "chat":
            return _prepare_chat(args)
        chosen = None
        if args.tokenizer is None:
            from mtcore.cli.data_tokenizer import config_tokenizer

            chosen = config_tokenizer(args.config)
            print(f"mtcore data prepare: tokenizer: {chosen.source}", file=sys.stderr)
        done = prepare_data(
            args.inputs,
            args.tokenizer or chosen.path,
            args.output,
            text_key=args.text_key,
            txt_separator=separator,
            workers=args.workers,
        )
        tokenizer = args.tokenizer
        if chosen is not None:
            from mtcore.cli.data_tokenizer import write_beside

            tokenizer = write_beside(chosen, done.prefix)
            print(f"mtcore data prepare: tokenizer written to {tokenizer}", file=sys.stderr)
    except (DataError, ConfigError) as e:  # the inputs or the tokenizer: nothing was written
        print(f"mtcore data prepare: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # writing failed (a full disk): the finished input files are kept
        print(
            f"mtcore data prepare: error: writing {args.output}: {e.strerror or e} "
            f"({e.filename or 'output'}); run the same command again to go on from the "
            "input files already done",
            file=sys.stderr,
        )
        return 1
    finally:
        report_to(None)
    state = "up to date" if done.up_to_date else f"written in {done.seconds:.1f} s"
    print(
        f"{done.prefix}.bin/.idx: {done.documents:,} documents, {done.tokens:,} tokens from "
        f"{done.files} file(s), {state}"
    )
    print(
        f"train on it: mtcore train CONFIG --data.paths {done.prefix} --data.tokenizer {tokenizer}"
    )
    return 0


def _prepare_chat(args: argparse.Namespace) -> int:
    """``--format chat``: render, write, summarise (DataError and OSError: the caller's)."""
    from mtcore.data.chat_prepare import prepare_chat
    from mtcore.data.chat_render import ChatRenderer
    from mtcore.data.corpus import find_files

    files = list(dict.fromkeys(f for path in args.inputs for f in find_files(path)))
    renderer = ChatRenderer(args.tokenizer, args.chat_template)
    done = prepare_chat(files, renderer, args.output)
    state = "up to date" if done.up_to_date else f"written in {done.seconds:.1f} s"
    print(
        f"{done.prefix}.bin/.idx/.mask: {done.conversations:,} conversations, {done.tokens:,} "
        f"tokens ({done.trained_tokens:,} in answers) from {len(files)} file(s), {state}"
    )
    template = (
        f" --data.chat_template {shlex.quote(args.chat_template)}" if args.chat_template else ""
    )
    print(
        f"train on it: mtcore train CONFIG --data.format chat --data.paths {done.prefix} "
        f"--data.tokenizer {args.tokenizer}{template}"
    )
    return 0


def _output_problem(output: str) -> str | None:
    """Why ``--output PREFIX`` cannot be written (its directory must exist), or None."""
    from pathlib import Path

    from mtcore.training.config import ConfigError
    from mtcore.training.writable import check_writable

    prefix = Path(output).expanduser()
    if prefix.is_dir():
        return f"is a directory; give a file prefix inside it, e.g. {prefix / 'corpus'}"
    directory = prefix.parent
    above = directory
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        return f"is under {above}, which is a file"
    if above != directory:
        return f"its directory {directory} does not exist; create it first"
    try:
        check_writable("its directory", directory)
    except ConfigError as e:
        return str(e)
    return None


def _unescape(text: str) -> str:
    """``\\n`` and ``\\t`` as typed on a command line, so ``--txt-separator '\\n---\\n'`` works."""
    return text.replace("\\n", "\n").replace("\\t", "\t")
