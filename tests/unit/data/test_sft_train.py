"""configs/sft.yaml trains (one process, two steps, a smaller model): the log's trained
tokens are the batch's labels that are not -100, and the loss is the mean over trained
tokens whatever the micro-batch split (micro-batches hold different numbers of them)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from mtcore.training.overrides import load_config
from mtcore.training.trainer import train

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[3]


def sft_config(chat_set, tmp_path, micro_batch_size: int, steps: int = 1):
    data, tokenizer = chat_set
    overrides = {
        "parallel.tp": 1, "model.hidden_size": 64, "model.num_layers": 2, "model.seq_len": 96,
        "data.paths": f"[{data}]", "data.tokenizer": str(tokenizer),
        "data.cache_dir": str(tmp_path / "cache"), "training.steps": steps,
        "training.global_batch_size": 8, "training.micro_batch_size": micro_batch_size,
        "training.eval_interval": 0, "logging.interval": 1,
        "checkpoint.dir": str(tmp_path / f"ck{micro_batch_size}"),
        "logging.tensorboard_dir": str(tmp_path / "tb"), "logging.progress": "lines",
    }  # fmt: skip
    argv = [f"--{key}={value}" for key, value in overrides.items()]
    return load_config(ROOT / "configs" / "sft.yaml", argv)


def test_sft_yaml_trains_and_logs_its_trained_tokens(chat_set, tmp_path):
    from mtcore.models import family_of

    config = sft_config(chat_set, tmp_path, micro_batch_size=8, steps=2)
    log = io.StringIO()
    whole = train(config, stream=log)
    trained = [int(n.replace(",", "")) for n in re.findall(r"\| ([\d,]+) trained tokens/step", log.getvalue())]  # fmt: skip
    data = family_of(config.model).data(config.data, config.model)
    loader = data.loader(
        data.train, micro_batch_size=8, global_batch_size=8, seed=config.training.seed
    )
    expected = [int((next(loader)["labels"] != -100).sum()) for _ in range(2)]
    assert trained == expected and 0 < expected[0] < 8 * 96
    # The chat template travels with the checkpoint, beside tokenizer.json.
    saved = json.loads((whole.checkpoint / "tokenizer_config.json").read_text())
    own = json.loads((chat_set[1] / "tokenizer_config.json").read_text())
    assert saved == own and "<|im_start|>" in saved["chat_template"]
    small = data.loader(
        data.train, micro_batch_size=2, global_batch_size=8, seed=config.training.seed
    )
    counts = {int((next(small)["labels"] != -100).sum()) for _ in range(4)}
    assert len(counts) > 1  # a mean of the micro-batches' means would differ
    split = train(sft_config(chat_set, tmp_path, micro_batch_size=2), stream=io.StringIO())
    # Four micro-batches of unequal trained counts give the same token mean as one.
    assert split.losses[0] == pytest.approx(whole.losses[0], rel=1e-5)
    assert_generate_renders_the_chat_template(whole.checkpoint, tmp_path)


def assert_generate_renders_the_chat_template(checkpoint, tmp_path):
    """`mtcore generate --chat` prompts the model with the template's rendering of a user
    turn (special tokens read as tokens) and prints the answer alone: the same text the
    model continues when given those ids directly, and the same as transformers answers
    with the model `mtcore convert to-hf` exported (its tokenizer keeps the template)."""
    import contextlib

    import torch
    import transformers

    from mtcore.backend import select_backend
    from mtcore.cli.main import main
    from mtcore.training.checkpoint import load_model

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", str(checkpoint), "--chat", "--prompt", "What is 2 + 3?",
                     "--max-new-tokens", "6"]) == 0  # fmt: skip
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(checkpoint))
    ids = hf.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=True,
                                 add_generation_prompt=True, return_dict=False)  # fmt: skip
    assert hf.convert_tokens_to_ids("<|im_start|>") in ids  # one token, not its characters
    model, _, _ = load_model(checkpoint, select_backend("cpu"))
    tokens = torch.tensor([list(ids)])
    answer = hf.decode(model.generate(tokens, 6)[0, tokens.shape[1] :].tolist())
    assert out.getvalue() == answer.split("<|im_end|>")[0] + "\n"

    exported = tmp_path / "hf"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["convert", "to-hf", str(checkpoint), str(exported)]) == 0
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(exported))
    assert hf_tokenizer.chat_template == hf.chat_template
    assert hf_tokenizer("<|im_start|>", add_special_tokens=False)["input_ids"] == [
        hf.convert_tokens_to_ids("<|im_start|>")]  # a token in a prompt, not its bytes
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(exported))
    prompt = hf_tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                              add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)  # fmt: skip
    generated = hf_model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert hf_tokenizer.decode(generated[0, prompt["input_ids"].shape[1] :]) == answer
