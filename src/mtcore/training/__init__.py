"""Training: config, the GPT engine and loop, checkpoints, generation; data in ``training.data``.

``train(load_config("configs/default.yaml", ["--parallel.tp", "2"]))`` runs a job on
this rank; ``mtcore train`` and ``torchrun -m mtcore.train`` launch it.
"""
