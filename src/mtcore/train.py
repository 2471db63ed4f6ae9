"""``torchrun --nproc-per-node N -m mtcore.train [CONFIG] [--section.key VALUE ...]``: one
training rank, for torchrun and Slurm. The rank is ``mtcore.training.rank``; `mtcore
train` forks its ranks from ``mtcore.training.rank_server`` instead."""

if __name__ == "__main__":
    from mtcore.training.rank import torchrun_rank

    torchrun_rank()
