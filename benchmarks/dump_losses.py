"""Every training and validation loss of a job at full precision, for bitwise comparisons.

    torchrun --nproc-per-node 4 benchmarks/dump_losses.py OUT.json configs/default.yaml \\
        --training.sample_tokens 0 --checkpoint.dir null --logging.tensorboard_dir null

Run it on two checkouts (``PYTHONPATH=<checkout>/src``) and compare the JSON files: a
refactor that must not change numerics gives equal ``losses`` lists. Rank 0 writes.
"""

from __future__ import annotations

import json
import os
import sys

from mtcore.training.overrides import load_config
from mtcore.training.trainer import train


def main() -> None:
    out, config, *overrides = sys.argv[1:]
    result = train(load_config(config, overrides))
    if int(os.environ.get("RANK", "0")) == 0:
        record = {
            "losses": [repr(loss) for loss in result.losses],
            "val": [[step, repr(loss)] for step, loss in result.val_losses],
        }
        with open(out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
