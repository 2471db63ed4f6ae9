"""mtcore: hybrid-parallel LLM training on any accelerator, through plugins."""

__version__ = "0.1.0"
