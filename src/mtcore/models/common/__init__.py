"""What the model families share; no family imports another family, they all compose this.

- ``layers``: the transformer blocks (``Context``, ``Norm``, ``Attention``, ``MLP``);
- ``chunks``: a stack of blocks as pipeline chunks (``PipelineChunk``, ``build_chunks``,
  ``hidden_state_messages``);
- ``decoder``: the decoder-only transformer (``GPT`` configured by ``DecoderConfig``;
  its HuggingFace mapping, full weights and planner shape): the GPT family's model and
  LLaVA's language model;
- ``sampling``: the generation loop (greedy or top-k);
- ``hf_files``, ``full_weights``, ``layout_checks``: HuggingFace directories, loading
  full weights into chunks, and the block-split checks of a layout.
"""
