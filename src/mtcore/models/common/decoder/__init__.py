"""The decoder-only transformer (Llama and GPT-2 styles, GQA, mixture of experts) that the
GPT family trains and LLaVA puts behind its vision tower: config, model, rotary tables,
full weights, HuggingFace mapping and planner shape."""
