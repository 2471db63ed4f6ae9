"""`mtcore train` refuses a LLaVA job that cannot work before any rank starts, at every
--nproc: image tokens that leave no room for text in seq_len (the embedded samples
included), an image normalisation that divides by zero or is no pixel statistic, and a
vision tower whose channel count is not the pixels'."""

from __future__ import annotations

import pytest
import yaml

from mtcore.cli.main import main
from tests.unit.training.test_vlm_training import LLAVA, _llava

CASES = [
    # 16px / 2px = 64 patches, seq_len 32: every step had no room for the caption.
    (["--model.vision.patch_size", "2"], "an image is 64 tokens"),
    (["--model.vision.keep_class_token", "true", "--model.seq_len", "5"],
     "an image is 5 tokens ((vision.image_size=16 / vision.patch_size=8)^2 patches and the "
     "class token"),
    # The image fits, its prompt and caption do not: said when the data is built.
    (["--model.seq_len", "8"], "shapes/train (caption 'one red square'): "),
    # Each of these trained to the end on NaN or nonsense pixels, exit 0.
    (["--model.images.std", "[0, 0.26, 0.27]"], "model.images.std"),
    (["--model.images.std", "[-0.27, 0.26, 0.27]"], "std must be positive"),
    (["--model.images.std", "[1e-45, 0.26, 0.27]"], "std must be positive"),
    (["--model.images.std", "[.inf, 0.26, 0.27]"], "model.images.std.0"),
    (["--model.images.mean", "[-0.5, 0.45, 0.4]"], "mean must lie in [0, 1]"),
    (["--model.images.mean", "[.nan, 0.45, 0.4]"], "model.images.mean.0"),
    # The patch embedding did not match the RGB pixels: a shape error in every rank.
    (["--model.vision.channels", "1"], "model.vision.channels=1, but images reach the model "
     "with 3 channels"),
    (["--model.vision.channels", "4"], "model.vision.channels=4"),
]  # fmt: skip


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_a_llava_job_that_cannot_work_is_refused_in_one_line(tiny, tmp_path, capsys, nproc):
    config = _llava(tiny, training={"steps": 1, "eval_interval": 0, "global_batch_size": 4,
                                    "micro_batch_size": 2})  # fmt: skip
    config["model"]["images"] = {**LLAVA["images"], "embedded_valid": 0}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    for arguments, said in CASES:
        out = tmp_path / "out"
        argv = ["train", str(path), "--nproc", nproc, "--checkpoint.dir", str(out), *arguments]
        assert main(argv) == 2, arguments
        err = capsys.readouterr().err
        # One line, or the config's own form: a line naming the file, then the key's.
        lines = err[err.index("mtcore train: error:") :].strip().splitlines()
        assert len(lines) <= 2 and said in err and "Traceback" not in err, (arguments, err)
        assert not out.exists(), arguments  # no rank ran
