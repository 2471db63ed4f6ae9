"""Training: config, the engine and loop (any model family), checkpoints, metrics; data in ``mtcore.data``.

``train(load_config("configs/default.yaml", ["--parallel.tp", "2"]))`` runs a job on
this rank; ``mtcore train`` and ``torchrun -m mtcore.train`` launch it.
"""
