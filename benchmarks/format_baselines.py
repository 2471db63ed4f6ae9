"""What configs/bert.yaml's and configs/t5.yaml's losses and accuracies would be without
reading any context: the baselines docs/models.md sets their figures against.

    .venv/bin/python benchmarks/format_baselines.py [--bert-checkpoint DIR] [--t5-checkpoint DIR] \\
        [--data.cache_dir DIR ...]

Builds each job's data as `mtcore train` does (the overrides go to both configs) and
prints, on the validation documents, with token frequencies from the training ones:

* the unigram cross-entropy (every token guessed from the corpus's frequencies) and
  the share of the most frequent token (the accuracy of always guessing it);
* BERT: the masked-LM loss of a predictor that knows the unigram frequencies and the
  80/10/10 masking rule but no context: unigram at a `[MASK]`, and at a visible token
  v (kept, or a uniform random replacement) v with the posterior that it was kept;
* T5: the target's make-up (sentinels and `</s>` against span tokens).

With a checkpoint directory of `mtcore train configs/bert.yaml` (``--bert-checkpoint``)
or `configs/t5.yaml` (``--t5-checkpoint``), that model's teacher-forced accuracy and
loss per kind of target token over 8 validation batches of 32, drawn as the job's
evaluation draws them (shuffled with its seed; the first 4 are its batches) (BERT: at `[MASK]`, at
kept and at randomly replaced tokens; T5: sentinels and `</s>`, span tokens), with the
masks of two sequences or the spans of two pieces as written and as predicted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mtcore.models.bert.data import PairLoader, build_pair_data
from mtcore.models.t5.data import IGNORE_INDEX, SpanLoader, build_span_data, span_lengths
from mtcore.training.checkpoint import load_model
from mtcore.training.overrides import load_config

ROOT = Path(__file__).resolve().parents[1]
MASKED, RANDOM, KEPT = 0.8, 0.1, 0.1  # BERT's masking rule (mtcore.models.bert.pair_loader)


def document_tokens(dataset) -> np.ndarray:
    """Every token of the dataset's documents, the end-of-document ids left out."""
    docs = [np.asarray(dataset.index.document(int(d)))[:-1] for d in dataset.doc_ids]
    return np.concatenate(docs).astype(np.int64)


def unigram(train: np.ndarray, vocab_size: int) -> np.ndarray:
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1e-3
    return counts / counts.sum()


def report_unigram(name: str, probs: np.ndarray, valid: np.ndarray, tokenizer) -> float:
    cross_entropy = float(-np.log(probs[valid]).mean())
    top = int(np.argmax(probs))
    share = float((valid == top).mean())
    print(
        f"{name}: unigram cross-entropy {cross_entropy:.3f} nats on {len(valid)} validation "
        f"tokens; the most frequent token {tokenizer.decode([top])!r} is {share:.1%} of them"
    )
    return cross_entropy


def bert_format_only(probs: np.ndarray, valid: np.ndarray, replacement_ids) -> tuple[float, float]:
    """(expected MLM loss, expected accuracy) per masked position on the tokens ``valid``
    of the context-free Bayes predictor that believes the unigram ``probs``: at
    `[MASK]` it predicts ``probs``; at a visible token v (kept, or drawn uniformly from
    ``replacement_ids``) v with the posterior that it was kept, else ``probs``."""
    truth = np.bincount(valid, minlength=len(probs)) / len(valid)  # what is to be predicted
    uniform = np.zeros_like(probs)
    uniform[replacement_ids] = 1.0 / len(replacement_ids)
    kept = KEPT * probs / (KEPT * probs + RANDOM * uniform)  # P(kept | visible v)
    at_visible = kept + (1 - kept) * probs  # its probability that the answer is v itself
    at_mask = -(truth * np.log(probs)).sum()
    at_kept = -(truth * np.log(at_visible)).sum()
    # Random r: the answer t is independent of r; P(t | r) = (1 - kept[r]) probs[t], and
    # at_visible[r] where t happens to be r.
    ids = np.asarray(replacement_ids)
    at_random = at_mask - np.log(1 - kept[ids]).mean()
    at_random += (
        truth[ids] * (np.log((1 - kept[ids]) * probs[ids]) - np.log(at_visible[ids]))
    ).mean()
    loss = MASKED * at_mask + KEPT * at_kept + RANDOM * at_random
    # Its guess at a visible v: v, unless the most frequent token is likelier.
    top = int(np.argmax(probs))
    guess = np.where(at_visible >= (1 - kept) * probs[top], np.arange(len(probs)), top)
    accuracy = (
        MASKED * truth[top]
        + KEPT * (truth * (guess == np.arange(len(probs)))).sum()
        + RANDOM * truth[guess[ids]].mean()
    )
    return float(loss), float(accuracy)


class KindTally:
    """Teacher-forced accuracy and loss of a trained model, per kind of target token."""

    def __init__(self, kinds: tuple[str, ...]):
        self.kinds = kinds
        self.right, self.total, self.loss = (torch.zeros(len(kinds)) for _ in range(3))

    def add(self, logits, labels, where: tuple) -> torch.Tensor:
        """Count one batch; ``where`` holds a bool mask per kind. Returns the argmax."""
        predicted = logits.argmax(-1)
        losses = F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        ).view_as(labels)
        real = labels != IGNORE_INDEX
        for kind, mask in enumerate(where):
            self.right[kind] += (predicted == labels)[real & mask].sum()
            self.total[kind] += (real & mask).sum()
            self.loss[kind] += losses[real & mask].sum()
        return predicted

    def report(self, name: str) -> None:
        rows = [
            (kind, self.right[i], self.total[i], self.loss[i]) for i, kind in enumerate(self.kinds)
        ]
        rows.append(("all", self.right.sum(), self.total.sum(), self.loss.sum()))
        for kind, right, total, loss in rows:
            print(
                f"{name}, {kind}: accuracy {right / total:.1%}, loss {loss / total:.3f} "
                f"({int(total)} tokens)"
            )


def t5_split(checkpoint: str, data, lengths, seed: int, batches: int = 8, batch_size: int = 32):
    """A trained T5's accuracy and loss on sentinels and `</s>` and on span tokens."""
    model, step, _ = load_model(checkpoint)
    loader = SpanLoader(
        data.valid, batch_size, seed=seed, encoder_len=lengths.encoder_len,
        decoder_len=lengths.decoder_len,
    )  # fmt: skip
    vocab, tokenizer = data.valid.vocab, data.tokenizer
    format_ids = torch.tensor([*vocab.sentinel_ids.tolist(), vocab.eos_id])
    tally = KindTally(("sentinels and </s>", "span tokens"))
    with torch.no_grad():
        for index in range(batches):
            batch = next(loader)
            logits = model(batch["tokens"], batch["decoder_tokens"], batch["padding_mask"])
            labels = batch["labels"]
            is_format = torch.isin(labels, format_ids)
            predicted = tally.add(logits, labels, (is_format, ~is_format))
            for row in range(2 if index == 0 else 0):
                real = labels[row] != IGNORE_INDEX
                print(f"  piece {row}, target:    {tokenizer.decode(labels[row][real].tolist())!r}")
                print(
                    f"  piece {row}, predicted: {tokenizer.decode(predicted[row][real].tolist())!r}"
                )
    tally.report(f"T5 step {step}")


def bert_split(checkpoint: str, data, mask_prob: float, seed: int, batches=8, batch_size=32):
    """A trained BERT's accuracy and loss at `[MASK]`, kept and randomly replaced tokens."""
    model, step, _ = load_model(checkpoint)
    loader = PairLoader(data.valid, batch_size, seed=seed, mask_prob=mask_prob)
    mask_id, tokenizer = data.valid.vocab.mask_id, data.tokenizer
    tally = KindTally(("[MASK]", "kept", "random"))
    with torch.no_grad():
        for index in range(batches):
            batch = next(loader)
            logits, _ = model(batch["tokens"], batch["token_types"], batch["padding_mask"])
            tokens, labels = batch["tokens"], batch["labels"]
            at_mask = tokens == mask_id
            kept = ~at_mask & (tokens == labels)
            predicted = tally.add(logits, labels, (at_mask, kept, ~at_mask & ~kept))
            if index == 0:
                rows, cols = torch.nonzero(at_mask[:2], as_tuple=True)
                filled = [
                    f"{tokenizer.decode([int(labels[r, c])])!r}->{tokenizer.decode([int(predicted[r, c])])!r}"
                    for r, c in zip(rows.tolist(), cols.tolist(), strict=True)
                ]
                print("  [MASK] in two sequences, written->predicted: " + ", ".join(filled))
    tally.report(f"BERT step {step}")


def main() -> None:
    overrides = sys.argv[1:]
    checkpoints = {}
    while overrides[:1] in (["--bert-checkpoint"], ["--t5-checkpoint"]):
        checkpoints[overrides[0]], overrides = overrides[1], overrides[2:]
    bert_config = load_config(ROOT / "configs" / "bert.yaml", overrides)
    model = bert_config.model
    bert = build_pair_data(
        bert_config.data, model.seq_len, model.pair_task, bert_config.training.seed
    )
    train, valid = document_tokens(bert.train), document_tokens(bert.valid)
    probs = unigram(train, bert.tokenizer.vocab_size)
    report_unigram("BERT", probs, valid, bert.tokenizer)
    loss, accuracy = bert_format_only(probs, valid, bert.valid.vocab.replacement_ids)
    print(
        f"BERT: the context-free predictor (unigram + the 80/10/10 rule): MLM loss "
        f"{loss:.3f}, accuracy {accuracy:.1%}"
    )
    if "--bert-checkpoint" in checkpoints:
        bert_split(
            checkpoints["--bert-checkpoint"], bert, model.mask_prob, bert_config.training.seed
        )

    t5_config = load_config(ROOT / "configs" / "t5.yaml", overrides)
    model = t5_config.model
    lengths = span_lengths(model.seq_len, model.noise_density, model.mean_span_length)
    t5 = build_span_data(
        t5_config.data, model.seq_len, lengths.decoder_len, model.noise_density,
        model.mean_span_length,
    )  # fmt: skip
    train, valid = document_tokens(t5.train), document_tokens(t5.valid)
    report_unigram("T5 span tokens", unigram(train, t5.tokenizer.vocab_size), valid, t5.tokenizer)
    special = (lengths.spans + 1) / lengths.decoder_len
    print(
        f"T5: a target of {lengths.decoder_len} tokens is {lengths.spans} sentinels, "
        f"{lengths.noise} span tokens and </s>: {special:.1%} sentinels and </s>"
    )
    if "--t5-checkpoint" in checkpoints:
        t5_split(checkpoints["--t5-checkpoint"], t5, lengths, t5_config.training.seed)


if __name__ == "__main__":
    main()
