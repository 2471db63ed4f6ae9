"""mtcore against Megatron-Core, side by side on CPU ranks (``benchmarks/bench_megatron.py``).

``configs``: the shared shapes, every configuration and the token batches both sides
train on; ``cpu_shims``: what Megatron-Core needs to run on CPU; ``instrument``: the
collective and backward clocks, and the background load; ``mtcore_side`` and
``megatron_gpt`` / ``megatron_encoders``: one training step of each side;
``rank_work``: what one rank runs (alternating rounds); ``report``: the printout.
"""
