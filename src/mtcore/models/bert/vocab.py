"""What BERT's pair data and masking need to know of a tokenizer (``PairVocab``), read by
the pair table (``data.py``) and the masking loader (``pair_loader.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mtcore.data.tokenizer import Tokenizer
from mtcore.models.bert.names import BERT_SPECIAL_TOKENS


@dataclass(frozen=True)
class PairVocab:
    """What the pair data needs to know of a tokenizer, computed once per job."""

    cls_id: int
    sep_id: int
    mask_id: int
    pad_id: int
    special_ids: np.ndarray  # sorted; never masked
    replacement_ids: np.ndarray  # sorted non-special ids a masked token may become
    ends_line: np.ndarray  # bool per id: the token's text holds a newline

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> PairVocab:
        cls_id, sep_id, mask_id, pad_id = (tokenizer.token_id(t) for t in BERT_SPECIAL_TOKENS)
        special = np.array(sorted(tokenizer.special_ids | {cls_id, sep_id, mask_id, pad_id}))
        ids = np.array(sorted(set(tokenizer.hf.get_vocab(with_added_tokens=True).values())))
        ends_line = np.zeros(tokenizer.vocab_size, dtype=bool)
        texts = tokenizer.hf.decode_batch([[int(i)] for i in ids], skip_special_tokens=False)
        ends_line[ids] = ["\n" in text for text in texts]
        ends_line[special] = False
        return cls(cls_id, sep_id, mask_id, pad_id, special, np.setdiff1d(ids, special), ends_line)
