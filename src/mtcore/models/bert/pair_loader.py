"""The masked-LM batch loader for pair datasets: TokenLoader's sampling, plus masking.

Sampling, data-parallel striding and the resumable state are ``TokenLoader``'s own
(``EpochSampler`` underneath, state counted in global samples). Masking is a pure
function of ``(seed, epoch the sample is drawn in, sample index)``: each sequence
gets its own numpy ``Generator`` seeded with that triple. So a loader restored from
``state_dict`` masks exactly as an uninterrupted one, a global batch split over any
data-parallel size is masked the same, and every epoch sees fresh masks of the same
sample (dynamic masking, as RoBERTa found better than BERT's fixed ones).

Masking follows BERT: ``mask_prob`` of a sequence's maskable tokens (not special,
not padding), rounded, but at least one so no sequence contributes zero MLM
targets; of those, 80% become ``[MASK]``, 10% a random non-special id and 10% stay.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mtcore.data.cache import DataError
from mtcore.data.loader import TokenLoader
from mtcore.models.bert.vocab import PairVocab

IGNORE_INDEX = -100  # torch's cross_entropy default: positions that are not MLM targets
_MASK_SALT = 0x3A5C_0DE5  # keeps mask draws apart from the sampler's (seed, epoch) stream


def mask_sequence(
    tokens: np.ndarray,
    length: int,
    vocab: PairVocab,
    rng: np.random.Generator,
    mask_prob: float = 0.15,
) -> tuple[np.ndarray, np.ndarray]:
    """(masked tokens, labels) for one sequence whose first ``length`` positions are real.

    ``labels`` holds the original id at every chosen position and ``IGNORE_INDEX``
    elsewhere; ``tokens`` is not modified.
    """
    maskable = np.flatnonzero(~np.isin(tokens[:length], vocab.special_ids))
    masked = tokens.copy()
    labels = np.full_like(tokens, IGNORE_INDEX)
    if len(maskable) == 0:
        return masked, labels
    count = max(1, round(mask_prob * len(maskable)))
    chosen = np.sort(rng.choice(maskable, size=count, replace=False))
    labels[chosen] = tokens[chosen]
    action = rng.random(count)
    to_mask, to_random = chosen[action < 0.8], chosen[(action >= 0.8) & (action < 0.9)]
    masked[to_mask] = vocab.mask_id
    masked[to_random] = rng.choice(vocab.replacement_ids, size=len(to_random))
    return masked, labels


class PairLoader(TokenLoader):
    """Yields one micro-batch dict of int64/bool tensors ``[micro_batch_size, seq_len]``, forever.

    Keys: ``tokens`` (masked), ``labels`` (original ids at masked positions, -100
    elsewhere), ``token_types`` (0 for ``[CLS] A [SEP]`` and padding, 1 for ``B [SEP]``),
    ``padding_mask`` (True on real tokens) and, unless the task is ``"none"``,
    ``pair_labels`` ``[micro_batch_size]``. ``dataset`` is a ``PairDataset`` or
    ``PairBlend``. For evaluation use ``shuffle=False`` and a fresh loader each time.
    """

    def __init__(self, dataset: Any, *args, mask_prob: float = 0.15, **kwargs):
        """``TokenLoader``'s arguments (``micro_batch_size``, ``global_batch_size``,
        ``dp_rank``, ``dp_size``, ``seed``, ``shuffle``), and ``mask_prob``: the share
        of each sequence's maskable tokens that become MLM targets."""
        if not 0.0 < mask_prob <= 1.0:
            raise DataError(f"mask_prob must be in (0, 1], got {mask_prob}")
        super().__init__(dataset, *args, **kwargs)
        self.seed, self.mask_prob = self.sampler.seed, mask_prob

    def next_draws(self) -> tuple[np.ndarray, np.ndarray]:
        """This rank's (sample indices, epoch each was drawn in) for the next micro-step."""
        epoch, position = self.sampler.epoch, self.sampler.position
        count = self.micro_batch_size * self.dp_size
        indices = self.sampler.take(count)
        epochs = epoch + (position + np.arange(count)) // self.sampler.num_samples
        return indices[self.dp_rank :: self.dp_size], epochs[self.dp_rank :: self.dp_size]

    def next_indices(self) -> np.ndarray:
        return self.next_draws()[0]

    def __next__(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        vocab = self.dataset.vocab
        rows: dict[str, list] = {
            "tokens": [], "labels": [], "token_types": [], "padding_mask": [], "pair_labels": []
        }  # fmt: skip
        for index, epoch in zip(*self.next_draws(), strict=True):
            sample = self.dataset[int(index)]
            rng = np.random.default_rng([self.seed, int(epoch), int(index), _MASK_SALT])
            masked, labels = mask_sequence(sample.tokens, sample.length, vocab, rng, self.mask_prob)
            rows["tokens"].append(masked)
            rows["labels"].append(labels)
            rows["token_types"].append(sample.token_types)
            rows["padding_mask"].append(np.arange(len(sample.tokens)) < sample.length)
            rows["pair_labels"].append(sample.pair_label)
        if self.dataset.pair_task == "none":
            del rows["pair_labels"]
        return {key: torch.from_numpy(np.stack(values)) for key, values in rows.items()}
