"""Rendered conversations as ``seq_len`` training samples: packed with documents, or padded.

A conversation of ``L`` tokens gives ``L - 1`` next-token positions (input ``ids[:-1]``,
targets ``ids[1:]``); a target is trained where the loss mask marks its token as an
answer (``data.chat_loss``: every assistant turn, or the last), else it is -100.

*Packing* (``data.packing: true``) is greedy next-fit in data order: conversations are
appended to the current sample while they fit in ``seq_len`` positions, and the next
one that does not starts a new sample (no conversation is ever split between samples).
Each sample carries ``documents`` (``mtcore.data.documents``): conversation ``k`` of a
sample is document ``k`` and the padding after the last one is one more, so attention
never crosses from one conversation into another. *Padding* (``packing: false``) puts
one conversation in each sample.

A conversation longer than ``seq_len`` positions is cut to its first ``seq_len``
(``data.overlong: truncate``; one cut so far that no answer token is left is dropped)
or refused (``refuse``), and the count is said either way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from mtcore.data.cache import DataError
from mtcore.data.chat_prepare import ChatIndex
from mtcore.data.chat_render import LAST_TURN
from mtcore.data.documents import DOCUMENTS
from mtcore.data.progress import say

log = logging.getLogger(__name__)
IGNORE_INDEX = -100


class ChatSamples:
    """``len(self)`` samples; ``[i]`` is a dict of int64 arrays ``[seq_len]``: ``tokens``,
    ``labels`` and (``documents=True``) ``documents``.

    ``parts``: ``(index, conversation ids)`` of each source (a split of it)."""

    def __init__(
        self,
        parts: Sequence[tuple[ChatIndex, np.ndarray]],
        seq_len: int,
        *,
        pad_id: int,
        packing: bool = True,
        overlong: str = "truncate",
        chat_loss: str = "all_assistant",
        documents: bool = True,
        name: str = "chat",
    ):
        self.parts = [index for index, _ in parts]
        self.seq_len, self.pad_id, self.name = seq_len, pad_id, name
        self.last_only, self.documents = chat_loss == "last_assistant", documents
        members = [
            (p, int(c)) for p, (_, ids) in enumerate(parts) for c in np.sort(np.asarray(ids))
        ]
        if not members:
            raise DataError(f"{name}: no conversations")
        self.conversations = len(members)
        self._source = np.asarray([p for p, _ in members], dtype=np.int64)
        self._conversation = np.asarray([c for _, c in members], dtype=np.int64)
        self._keep_fitting(overlong)
        self._bounds = self._pack(packing)

    def _positions(self) -> np.ndarray:
        """Next-token positions of each member before any cut (tokens - 1)."""
        lengths = np.empty(len(self._conversation), dtype=np.int64)
        for p, index in enumerate(self.parts):
            here = self._source == p
            offsets = index.tokens.offsets
            ids = self._conversation[here]
            lengths[here] = offsets[ids + 1] - offsets[ids]
        return lengths - 1

    def _keep_fitting(self, overlong: str) -> None:
        positions = self._positions()
        long = positions > self.seq_len
        self.overlong = int(long.sum())
        if self.overlong and overlong == "refuse":
            raise DataError(
                f"{self.name}: {self.overlong} of {self.conversations} conversation(s) are longer "
                f"than seq_len={self.seq_len} tokens (the longest: {int(positions.max()) + 1}); "
                "raise model.seq_len, or set data.overlong truncate"
            )
        kept = positions >= 1
        for m in np.flatnonzero(long):  # cut: does any answer token survive?
            kept[m] = self._trained(m, self.seq_len + 1).any()
        self.dropped = int((long & ~kept).sum())
        if self.overlong:
            message = (
                f"{self.name}: {self.overlong} of {self.conversations} conversation(s) longer "
                f"than seq_len={self.seq_len} tokens, truncated"
                + (f"; {self.dropped} of them kept no answer token and are left out"
                   if self.dropped else "")
            )  # fmt: skip
            say(message)
            log.info(message)
        self._source, self._conversation = self._source[kept], self._conversation[kept]
        self._length = np.minimum(positions[kept], self.seq_len)
        if not len(self._length):
            raise DataError(f"{self.name}: no conversation has an answer within seq_len")

    def _tokens(self, member: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
        index = self.parts[int(self._source[member])]
        c = int(self._conversation[member])
        start = int(index.tokens.offsets[c])
        end = min(int(index.tokens.offsets[c + 1]), start + limit)
        return np.asarray(index.tokens.tokens[start:end], dtype=np.int64), index.mask[start:end]

    def _trained(self, member: int, limit: int) -> np.ndarray:
        """Whether each target (token 1..) of ``member`` is trained, under ``chat_loss``."""
        mask = self._tokens(member, limit)[1][1:]
        return mask == LAST_TURN if self.last_only else mask > 0

    def _pack(self, packing: bool) -> np.ndarray:
        """Offsets into the members of each sample's first member (last = count)."""
        if not packing:
            return np.arange(len(self._length) + 1, dtype=np.int64)
        starts, used = [0], 0
        for m, n in enumerate(self._length.tolist()):
            if used + n > self.seq_len:
                starts.append(m)
                used = 0
            used += n
        return np.asarray([*starts, len(self._length)], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._bounds) - 1

    @property
    def trained_tokens(self) -> int:
        """Targets trained over all samples (for the log and the tests)."""
        return sum(int(self._trained(m, self.seq_len + 1).sum()) for m in range(len(self._length)))

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {self.name} ({len(self)} samples)")
        tokens = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        documents = np.zeros(self.seq_len, dtype=np.int64)
        at = 0
        for k, m in enumerate(range(self._bounds[i], self._bounds[i + 1])):
            ids, _ = self._tokens(m, self.seq_len + 1)
            n = len(ids) - 1
            tokens[at : at + n] = ids[:-1]
            labels[at : at + n] = np.where(
                self._trained(m, self.seq_len + 1), ids[1:], IGNORE_INDEX
            )
            documents[at : at + n] = k
            at += n
        if at < self.seq_len:  # the padding is a document of its own
            documents[at:] = documents[at - 1] + 1
        sample = {"tokens": tokens, "labels": labels}
        if self.documents:
            sample[DOCUMENTS] = documents
        return sample

    def __repr__(self) -> str:
        fill = self._length.sum() / (len(self) * self.seq_len)
        return (
            f"ChatSamples({self.name}: {len(self._length)} conversations in {len(self)} samples "
            f"of {self.seq_len}, {fill:.0%} filled, {self.overlong} truncated)"
        )
