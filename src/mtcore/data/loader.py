"""The deterministic, resumable, data-parallel sampler and the batch loader on top of it.

Samples are drawn from an endless stream: epoch 0's permutation of the sample
indices, then epoch 1's, and so on, each permutation from numpy's ``Generator``
seeded with ``(seed, epoch)`` so any epoch can be regenerated without replaying the
ones before it. The whole state is ``(epoch, position in that epoch)``; a loader
rebuilt from a saved state continues with exactly the next sample, which is what
makes a resumed run bit-identical to an uninterrupted one. An epoch's tail is not
dropped: a global batch that straddles two epochs takes the end of one and the
start of the next, so no sample is skipped.

Each micro-step consumes ``micro_batch_size * dp_size`` consecutive positions of
the stream and rank ``r`` takes every ``dp_size``-th of them starting at ``r``; over
the ``grad_accum`` micro-steps of one optimizer step, rank ``r`` has therefore read
the strided slice ``global_batch[r::dp_size]``. The state is the same on every
rank (save it from any one), and, being counted in global samples, it stays valid
when a job resumes with a different data-parallel size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mtcore.data.cache import DataError
from mtcore.data.documents import (
    DOCUMENTS,
    POSITIONS,
    documents_from_separators,
    positions_in_documents,
)


@dataclass(frozen=True)
class SampleGroup:
    """The ranks that read the same samples: one model replica (its tp x pp ranks).
    ``any(flags)``: a bool tensor, True where any of them holds True (a collective: every
    member calls it at the same point); ``speaks``: this rank reports what they found.
    A loader that reads files as it draws samples uses it so that all of them drop the
    same samples when a file changes under the job."""

    any: Callable[[torch.Tensor], torch.Tensor]
    speaks: bool


ALONE = SampleGroup(lambda flags: flags, True)
"""The group of one rank."""


class SamplesLost(DataError):
    """Training cannot go on: too many samples became unreadable under the job.
    ``said``: this rank is the one of its ``SampleGroup`` that reports it."""

    def __init__(self, message: str, said: bool):
        super().__init__(message)
        self.said = said


class EpochSampler:
    """An endless, seeded stream of sample indices in ``[0, num_samples)``."""

    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True):
        if num_samples < 1:
            raise DataError(f"cannot sample from a dataset of {num_samples} samples")
        self.num_samples, self.seed, self.shuffle = int(num_samples), int(seed), shuffle
        self.epoch = 0
        self.position = 0
        self._perm: tuple[int, np.ndarray] | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            self._perm = (epoch, order)
        return self._perm[1]

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` sample indices of the stream; advances the state."""
        out = []
        while n > 0:
            k = min(n, self.num_samples - self.position)
            out.append(self.permutation(self.epoch)[self.position : self.position + k])
            self.position += k
            n -= k
            if self.position == self.num_samples:
                self.epoch, self.position = self.epoch + 1, 0
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A different dataset size or seed would make the saved position point at
        # other samples: resuming would silently repeat and skip data.
        for key in ("seed", "num_samples", "shuffle"):
            if state[key] != getattr(self, key):
                raise DataError(
                    f"cannot resume the data sampler: saved {key}={state[key]!r} but this run has "
                    f"{key}={getattr(self, key)!r} (did the data, seq_len, split or seed change?)"
                )
        if not 0 <= state["position"] < self.num_samples or state["epoch"] < 0:
            raise DataError(f"cannot resume the data sampler: invalid state {state}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def check_batch_sizes(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Return ``grad_accum`` for ``global = micro * dp * grad_accum``, or raise naming the numbers."""
    if micro_batch_size < 1 or dp_size < 1 or global_batch_size < 1:
        raise DataError(
            f"batch sizes must be positive: global_batch_size={global_batch_size}, "
            f"micro_batch_size={micro_batch_size}, dp_size={dp_size}"
        )
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:
        raise DataError(
            f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size * dp_size "
            f"= {micro_batch_size} * {dp_size} = {per_step}; global_batch_size must equal "
            f"micro_batch_size * dp_size * grad_accum"
        )
    return global_batch_size // per_step


class TokenLoader:
    """Yields ``(tokens, targets)``, two int64 tensors ``[micro_batch_size, seq_len]``, forever.

    ``dataset`` is anything with ``len()``, ``seq_len`` and ``[i] -> seq_len + 1`` ids
    (a ``SequenceDataset`` or a ``BlendedDataset``). For evaluation use
    ``shuffle=False`` and a fresh loader per evaluation, so every evaluation sees the
    same batches.
    """

    def __init__(
        self,
        dataset: Any,
        micro_batch_size: int,
        global_batch_size: int | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if global_batch_size is None:
            global_batch_size = micro_batch_size * dp_size
        self.grad_accum = check_batch_sizes(global_batch_size, micro_batch_size, dp_size)
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        self.dataset = dataset
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.sampler = EpochSampler(len(dataset), seed, shuffle)

    def next_indices(self) -> np.ndarray:
        """This rank's sample indices for the next micro-step (advances the shared state)."""
        return self.sampler.take(self.micro_batch_size * self.dp_size)[self.dp_rank :: self.dp_size]

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = np.stack([self.dataset[int(i)] for i in self.next_indices()]).astype(np.int64)
        tokens = torch.from_numpy(batch[:, :-1].copy())
        targets = torch.from_numpy(batch[:, 1:].copy())
        return tokens, targets

    @property
    def samples_consumed(self) -> int:
        """Global samples consumed so far, over all ranks."""
        return self.sampler.epoch * self.sampler.num_samples + self.sampler.position

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])


class LMLoader:
    """Packed next-token micro-batches ``{"tokens", "labels"}`` from a ``TokenLoader``: what
    any next-token language model family reads (GPT's, the example family's).

    ``separator_id`` (``data.document_masks``): the batch also carries ``documents``, a
    new one after each ``separator_id`` (the end-of-document id); ``reset_position_ids``:
    and ``positions`` counted from each document's start (``mtcore.data.documents``)."""

    def __init__(
        self, dataset, separator_id: int | None = None, reset_position_ids: bool = False, **kwargs
    ):
        if reset_position_ids and separator_id is None:
            raise DataError("reset_position_ids needs documents: give separator_id")
        self.tokens = TokenLoader(dataset, **kwargs)
        self.separator_id, self.reset_position_ids = separator_id, reset_position_ids

    def __iter__(self) -> LMLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        tokens, labels = next(self.tokens)
        batch = {"tokens": tokens, "labels": labels}
        if self.separator_id is not None:
            batch[DOCUMENTS] = documents_from_separators(tokens, self.separator_id)
            if self.reset_position_ids:
                batch[POSITIONS] = positions_in_documents(batch[DOCUMENTS])
        return batch

    def state_dict(self) -> dict[str, Any]:
        return self.tokens.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tokens.load_state_dict(state)


class SampleLoader(TokenLoader):
    """Micro-batches of a dataset whose samples are dicts of equal-length int64 arrays
    (``ChatSamples``: ``tokens``, ``labels``, ``documents``), stacked into ``[b, s]``
    tensors; the sampler, its data-parallel striding and its state are ``TokenLoader``'s.
    ``reset_position_ids``: ``positions`` from the ``documents``."""

    def __init__(self, dataset, reset_position_ids: bool = False, **kwargs):
        super().__init__(dataset, **kwargs)
        self.reset_position_ids = reset_position_ids

    def __next__(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        samples = [self.dataset[int(i)] for i in self.next_indices()]
        batch = {
            name: torch.from_numpy(np.stack([s[name] for s in samples])) for name in samples[0]
        }
        if self.reset_position_ids:
            batch[POSITIONS] = positions_in_documents(batch[DOCUMENTS])
        return batch


def lm_batches(tokens, labels) -> list[dict[str, torch.Tensor]]:
    """Micro-batches ``{"tokens", "labels"}`` from matching lists of tensors (for tests and
    benchmarks that build their own token batches)."""
    return [{"tokens": x, "labels": y} for x, y in zip(tokens, labels, strict=True)]
