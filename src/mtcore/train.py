"""One training rank: ``torchrun --nproc-per-node N -m mtcore.train [CONFIG] [--section.key VALUE ...]``.

``mtcore train`` starts these ranks itself; run this module directly under
``torchrun`` (or Slurm's ``srun`` + ``torchrun``) for several nodes. Every rank
validates the config; only rank 0 prints a problem with it. Exit status: 0 done,
1 training failed, 2 bad input (nothing was trained).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from mtcore.training.checkpoint import CheckpointError
    from mtcore.training.config import ConfigError
    from mtcore.training.overrides import load_config
    from mtcore.training.trainer import TrainingError, train

    argv = sys.argv[1:] if argv is None else argv
    config_path = argv[0] if argv and not argv[0].startswith("--") else None
    overrides = argv[1:] if config_path is not None else argv
    loud = int(os.environ.get("RANK", "0")) == 0
    try:
        train(load_config(config_path, overrides))
    except (ConfigError, CheckpointError) as e:  # bad input: nothing was trained
        if loud:
            print(f"mtcore train: error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        if loud:
            print(f"mtcore train: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
