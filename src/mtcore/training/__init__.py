"""Training: configuration, data, the trainer loop, checkpoints, optimizers and schedules."""
