"""Training: config, the engine and loop (any model family), checkpoints, metrics; data in ``mtcore.data``.

``train(load_config("configs/default.yaml", ["--parallel.tp", "2"]))`` runs a job on
this rank. Where a job starts: ``mtcore train`` (``mtcore.cli.train``, ``mtcore.cli.launch``)
forks each rank (``rank.py``) from a rank server (``rank_server.py``); ``torchrun -m
mtcore.train`` starts the same rank in a new interpreter.
"""
