"""Names the T5 family declares without loading its model or data pipeline (torch): the
embedding and its tied head in a checkpoint, and the tokenizer's special tokens."""

EMBEDDING, LM_HEAD = "embed.weight", "lm_head.weight"
NUM_SENTINELS = 100  # T5's extra_ids
PAD_TOKEN, EOS_TOKEN = "<pad>", "</s>"
SENTINEL_TOKENS = tuple(f"<extra_id_{k}>" for k in range(NUM_SENTINELS))
T5_SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, *SENTINEL_TOKENS)
