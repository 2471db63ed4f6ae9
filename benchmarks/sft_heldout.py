"""After SFT on the embedded chat set: does the model answer the held-out prompts in the
template's format, and correctly, more often than the model it started from?

    .venv/bin/python benchmarks/sft_heldout.py CHECKPOINT CHAT_SET_DIR

CHECKPOINT: a checkpoint of ``configs/sft.yaml`` (its ``tokenizer_config.json`` holds the
chat template); CHAT_SET_DIR: ``python -m mtcore.data.chat_corpus DIR``'s directory
(``heldout.jsonl``, prompts the training set never asks). Each prompt is rendered with
``apply_chat_template(..., add_generation_prompt=True)`` and answered greedily (up to 24
tokens). "format": the answer ends with ``<|im_end|>``; "correct": and it is the
expected one. The base is the same config's fresh initialisation (the training seed),
what training started from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers

from mtcore.backend import select_backend
from mtcore.models import family_of
from mtcore.training.checkpoint import load_model


def answers(model, hf, prompts: list[str], max_new_tokens: int = 24) -> list[str]:
    out = []
    for prompt in prompts:
        ids = hf.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                     add_generation_prompt=True, return_dict=False)  # fmt: skip
        tokens = torch.tensor([list(ids)])
        with torch.no_grad():
            generated = model.generate(tokens, max_new_tokens)[0, tokens.shape[1] :]
        out.append(hf.decode(generated.tolist()))
    return out


def score(replies: list[str], expected: list[str]) -> tuple[int, int]:
    formatted = [r.split("<|im_end|>")[0] for r in replies if "<|im_end|>" in r]
    correct = sum(
        "<|im_end|>" in r and r.split("<|im_end|>")[0].strip() == e
        for r, e in zip(replies, expected, strict=True)
    )
    return len(formatted), correct


def main(checkpoint: str, chat_set: str) -> None:
    backend = select_backend("cpu")
    trained, step, directory = load_model(checkpoint, backend)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    records = [json.loads(line) for line in (Path(chat_set) / "heldout.jsonl").open()]
    prompts, expected = [r["prompt"] for r in records], [r["completion"] for r in records]
    torch.manual_seed(1234)  # configs/sft.yaml's training.seed
    base = family_of(trained.config).one_process(trained.config, backend)
    base.train(False)
    for name, model in (("base (step 0)", base), (f"trained (step {step})", trained)):
        replies = answers(model, hf, prompts)
        formatted, correct = score(replies, expected)
        print(f"{name}: {formatted}/{len(prompts)} in the template's format, "
              f"{correct}/{len(prompts)} correct; e.g. {prompts[1]!r} -> {replies[1]!r}")  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:3])
