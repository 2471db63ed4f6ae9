"""Continue a prompt with a trained model: `mtcore generate CHECKPOINT --prompt TEXT`.

CHECKPOINT is a checkpoint directory written by `mtcore train` (a step_N
directory, or the checkpoint root: its latest step). One process, the whole
model, whatever layout trained it. Greedy decoding by default; `--top-k K`
samples among the K likeliest tokens (--temperature, --seed). Prints the prompt
and its continuation. Families that do not generate (an encoder such as BERT) are
refused with one line. ``--image PATH`` gives a vision-language model (the llava
family) an image to answer from; the prompt may be given after the checkpoint too:
``mtcore generate CHECKPOINT --image a.png "What is in the image?"``, and the
answer alone is printed. ``--chat`` renders the prompt as a user turn (after
``--system`` TEXT) with the chat template the checkpoint holds (its
``tokenizer_config.json``, saved by a ``data.format: chat`` run), through transformers'
``apply_chat_template`` as training did, and prints the answer alone, up to the
template's end-of-turn token.
"""

from __future__ import annotations

import argparse
import math
import sys

HELP = "continue a prompt with a trained checkpoint (greedy or top-k sampling)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint directory (step_N, or the root: latest)")
    parser.add_argument("--prompt", default="", help="text to continue (default: empty)")
    parser.add_argument("text", nargs="?", default=None, help="the prompt (instead of --prompt)")
    parser.add_argument(
        "--image", nargs="+", default=None, metavar=("PATH", "PROMPT"),
        help="an image for a vision-language model, optionally followed by the prompt",
    )  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=100, metavar="N")
    parser.add_argument("--top-k", type=int, default=None, metavar="K", help="sample (default: greedy)")
    parser.add_argument("--temperature", type=float, default=1.0, help="with --top-k (default 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="with --top-k (default 0)")
    parser.add_argument("--backend", default=None, help="backend name (default: selected)")
    parser.add_argument(
        "--chat", action="store_true",
        help="the prompt is a user turn of the checkpoint's chat template; print the answer",
    )  # fmt: skip
    parser.add_argument("--system", default=None, help="with --chat: a system message first")


def run(args: argparse.Namespace) -> int:
    import torch

    from mtcore.backend import BackendError, select_backend
    from mtcore.data import DataError, load_tokenizer
    from mtcore.models import family_of
    from mtcore.training.checkpoint import load_model

    problem = _bad_arguments(args)
    if problem is None:
        try:
            backend = select_backend(args.backend)
        except BackendError as e:  # an unknown or unavailable --backend
            problem = str(e)
    if problem is not None:
        print(f"mtcore generate: error: {problem}", file=sys.stderr)
        return 2
    try:
        from mtcore.cli.converted import step_to_read

        directory, said = step_to_read("generate", args.checkpoint)  # one directory, said
        model, _step, directory = load_model(directory, backend)
        tokenizer = load_tokenizer(directory / "tokenizer.json")
    except (FileNotFoundError, ValueError, DataError) as e:  # CheckpointError too: bad input
        print(f"mtcore generate: error: {e}", file=sys.stderr)
        return 2
    family = family_of(model.config)
    if not family.capabilities.generates:
        print(f"mtcore generate: error: the {family.name} family does not generate text", file=sys.stderr)
        return 2
    prompt, extra = args.prompt if args.text is None else args.text, {}
    if args.image is not None:
        if not family.capabilities.reads_images:
            print(f"mtcore generate: error: the {family.name} family does not read images (--image)", file=sys.stderr)
            return 2
        extra["image"], *rest = args.image
        prompt = rest[0] if rest else prompt
    generator = torch.Generator(device=backend.torch_device()).manual_seed(args.seed)
    try:
        rendered, end_of_turn = prompt, None
        if args.chat:
            rendered, end_of_turn = chat_prompt(directory, prompt, args.system)
            tokenizer = tokenizer.reading_special_tokens()
        text = family.generate(
            model, tokenizer, rendered, args.max_new_tokens, args.top_k, args.temperature,
            generator, **extra,
        )  # fmt: skip
    except DataError as e:  # an unreadable image, a prompt that does not fit, no template
        print(f"mtcore generate: error: {e}", file=sys.stderr)
        return 2
    print(said, file=sys.stderr)  # on stderr: stdout is the text alone
    if args.chat:
        answer = text.removeprefix(rendered)
        print(answer.split(end_of_turn)[0] if end_of_turn else answer)
        return 0
    print(text if prompt else text.removeprefix(tokenizer.decode([tokenizer.eod_id])))
    return 0


def chat_prompt(directory, prompt: str, system: str | None) -> tuple[str, str | None]:
    """(the prompt rendered as a user turn by the checkpoint's chat template with the
    generation prompt, the template's end-of-turn token or None); a DataError when the
    checkpoint holds no template (it was not trained with ``data.format: chat``)."""
    from mtcore.data import DataError
    from mtcore.data.chat_render import ChatRenderer

    if not (directory / "tokenizer_config.json").is_file():
        raise DataError(
            f"--chat: checkpoint {directory} holds no chat template (tokenizer_config.json; "
            "a data.format chat run saves one)"
        )
    renderer = ChatRenderer(directory)
    messages = [{"role": "system", "content": system}] if system is not None else []
    text = renderer.text([*messages, {"role": "user", "content": prompt}], generation_prompt=True)
    return text, renderer.hf.eos_token


def _bad_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the numbers given, before anything loads (argparse takes
    ``nan`` and ``inf`` as floats; sampling with them gives garbage or a crash)."""
    given = [args.text, args.prompt or None, *(args.image or [None, None])[1:]]
    if len(args.image or ()) > 2:
        return "--image takes a path and at most one prompt"
    if sum(p is not None for p in given) > 1:
        return "give the prompt once: --prompt TEXT, after the checkpoint, or after --image PATH"
    if args.system is not None and not args.chat:
        return "--system needs --chat"
    if args.chat and args.image is not None:
        return "--chat renders text turns; it does not take --image"
    if args.max_new_tokens < 0 or (args.top_k is not None and args.top_k < 1):
        return "--max-new-tokens must be >= 0 and --top-k >= 1"
    if not math.isfinite(args.temperature) or args.temperature <= 0:
        return f"--temperature must be a finite number > 0, got {args.temperature}"
    if not -(2**63) <= args.seed < 2**64:
        return f"--seed must fit in 64 bits, got {args.seed}"
    return None
