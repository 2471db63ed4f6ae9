"""Names the BERT family declares without loading its model or data pipeline (torch): the
word embedding and its tied copy in a checkpoint, and the tokenizer's special tokens."""

WORD_EMBEDDING = "embed.word.weight"
DECODER_COPY = "mlm.decoder.weight"  # the last stage's copy of the word embedding
BERT_SPECIAL_TOKENS = ("[CLS]", "[SEP]", "[MASK]", "[PAD]")
